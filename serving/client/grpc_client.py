"""Python clients of the shiftjax gRPC API: :class:`Client` (blocking) and :class:`AsyncClient`
(asyncio). Neither imports JAX: a client process needs only grpcio and protobuf.

``generate`` and ``chat`` stream :class:`~shiftjax.serving.proto.shiftjax.v1.inference_pb2.GenerateResponse`
messages as the server produces them; ``complete`` collects one stream into a
:class:`Completion`. Sampling options are the fields of ``GenerateRequest`` (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``logprobs``, ``top_logprobs``), and ``cache_salt``: the request shares
cached prompt pages only with requests of the same salt (``usage.cached_prompt_tokens`` says
how many prompt tokens were found cached). ``structured_outputs`` constrains the output
(:class:`StructuredOutputs`: a JSON schema, any JSON object, a regex, a choice or a grammar).
``disable_speculation=True`` keeps the request out of speculative decoding on a server that
speculates (``info().speculative`` says whether it does, and what it has accepted).
Errors are ``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2_grpc as pb_grpc

FINISH_REASON_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                       pb.FINISH_REASON_ABORT: "abort"}


@dataclasses.dataclass
class Completion:
    """One request's whole output, gathered from its stream."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.request_id = response.request_id or self.request_id
        self.text += response.text
        self.token_ids += response.token_ids
        self.logprobs += response.logprobs
        if response.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(response.finish_reason, str(response.finish_reason))
        if response.HasField("usage"):
            self.usage = response.usage


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match, exactly one of: ``json_schema``, a JSON schema (a dict, or
    its JSON text); ``json_object``, any JSON object; ``regex``, a regular
    expression the whole output matches (Rust ``regex`` syntax); ``choice``, one of these
    strings; ``grammar``, a Lark grammar or llama.cpp's GBNF (its text). The server says
    whether it compiles (INVALID_ARGUMENT naming ``structured_outputs.<field>``)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs: give exactly one of json_schema, json_object, regex, choice, "
                             f"grammar; got {', '.join(given) or 'none'}")
        if isinstance(self.choice, str):  # a lone string would be read as its characters
            raise ValueError("structured outputs: choice must be a list of strings, not one string")

    def to_proto(self) -> pb.StructuredOutputs:
        if self.json_schema is not None:
            schema = self.json_schema
            return pb.StructuredOutputs(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
        if self.json_object:
            return pb.StructuredOutputs(json_object=True)
        if self.choice is not None:
            return pb.StructuredOutputs(choice=pb.ChoiceList(choices=list(self.choice)))
        if self.regex is not None:
            return pb.StructuredOutputs(regex=self.regex)
        return pb.StructuredOutputs(grammar=self.grammar)


def generate_request(prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                     messages: Sequence[dict] | None = None,
                     structured_outputs: StructuredOutputs | pb.StructuredOutputs | None = None,
                     **sampling) -> pb.GenerateRequest:
    """A ``GenerateRequest`` from one of a text prompt, token ids or chat messages
    (``[{"role": "user", "content": "..."}]``), sampling fields and an optional constraint
    (:class:`StructuredOutputs`, or the proto message itself)."""
    chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
    if isinstance(structured_outputs, StructuredOutputs):
        structured_outputs = structured_outputs.to_proto()
    return pb.GenerateRequest(prompt=prompt or "", prompt_ids=list(prompt_ids or ()), messages=chat,
                              structured_outputs=structured_outputs, **sampling)


def _channel_args(server: str, tls: bool, root_certificates: bytes | None, server_name: str | None):
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    credentials = grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates else None
    return server, credentials, options


class _Common:
    def __init__(self, api_key: str | None, timeout: float | None):
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout

    def _call_options(self, timeout):
        return {"metadata": self._metadata, "timeout": self.timeout if timeout is None else timeout}


class Client(_Common):
    """A blocking client. ``server`` is ``host:port``; ``tls=True`` verifies the server with
    the system roots or ``root_certificates`` (PEM bytes); ``api_key`` is sent as a bearer
    token on every call; ``timeout`` (seconds) is the default deadline of each call."""

    def __init__(self, server: str = "127.0.0.1:50051", *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, server_name: str | None = None,
                 timeout: float | None = None):
        super().__init__(api_key, timeout)
        target, credentials, options = _channel_args(server, tls, root_certificates, server_name)
        self.channel = (grpc.secure_channel(target, credentials, options) if credentials
                        else grpc.insecure_channel(target, options))
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **fields) -> Iterator[pb.GenerateResponse]:
        """Streams the responses; leaving the loop early cancels the request on the server."""
        call = self.stub.Generate(generate_request(prompt, **fields), **self._call_options(timeout))
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    def chat(self, messages: Sequence[dict], **fields) -> Iterator[pb.GenerateResponse]:
        return self.generate(messages=messages, **fields)

    def complete(self, prompt: str | None = None, **fields) -> Completion:
        completion = Completion()
        for response in self.generate(prompt, **fields):
            completion.add(response)
        return completion

    def tokenize(self, text: str = "", *, messages: Sequence[dict] | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
        request = pb.TokenizeRequest(text=text, messages=chat, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, **self._call_options(None)).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, **self._call_options(None)).text

    def info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest(), **self._call_options(None))

    def health(self, service: str = "") -> str:
        """``SERVING``, ``NOT_SERVING`` or ``UNREACHABLE`` (no answer)."""
        try:
            response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout: float = 600.0, poll_seconds: float = 0.5) -> None:
        """Returns once health says SERVING; TimeoutError after ``timeout`` seconds."""
        give_up = time.monotonic() + timeout
        while (status := self.health()) != "SERVING":
            if time.monotonic() > give_up:
                raise TimeoutError(f"the server did not become SERVING within {timeout:.0f} s (last: {status})")
            time.sleep(poll_seconds)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Common):
    """The asyncio twin of :class:`Client` (same arguments); create it inside a running loop."""

    def __init__(self, server: str = "127.0.0.1:50051", *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, server_name: str | None = None,
                 timeout: float | None = None):
        super().__init__(api_key, timeout)
        target, credentials, options = _channel_args(server, tls, root_certificates, server_name)
        self.channel = (grpc.aio.secure_channel(target, credentials, options) if credentials
                        else grpc.aio.insecure_channel(target, options))
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **fields) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(generate_request(prompt, **fields), **self._call_options(timeout))
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    def chat(self, messages: Sequence[dict], **fields) -> AsyncIterator[pb.GenerateResponse]:
        return self.generate(messages=messages, **fields)

    async def complete(self, prompt: str | None = None, **fields) -> Completion:
        completion = Completion()
        async for response in self.generate(prompt, **fields):
            completion.add(response)
        return completion

    async def tokenize(self, text: str = "", *, messages: Sequence[dict] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
        request = pb.TokenizeRequest(text=text, messages=chat, add_special_tokens=add_special_tokens)
        return list((await self.stub.Tokenize(request, **self._call_options(None))).token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, **self._call_options(None))).text

    async def info(self) -> pb.ServerInfoResponse:
        return await self.stub.ServerInfo(pb.ServerInfoRequest(), **self._call_options(None))

    async def health(self, service: str = "") -> str:
        try:
            response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
