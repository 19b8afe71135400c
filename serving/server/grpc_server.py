"""The gRPC front end: ``shiftjax.v1.InferenceService`` over an engine service, with the
standard health and reflection services, optional TLS and a bearer token.

A thin adapter: requests become :class:`GenerationRequest`, deltas become responses, and
the service's exceptions become status codes in :func:`status_of`. Closing the service's
stream is what cancels a request, so the ``finally`` around the stream is the whole of
cancellation: grpc.aio cancels the handler's task when the client cancels, disconnects or
its deadline passes, and the stream's ``aclose()`` frees the request's pages at once. The
service alone says a request ended for its deadline (:class:`DeadlineExceeded`).

Against hostile clients: messages past ``max_message_bytes`` are
RESOURCE_EXHAUSTED before a byte is parsed, bytes that are no request message are
INVALID_ARGUMENT (:class:`UndecodableRequestInterceptor`), tokenizing runs on a
:class:`TokenizePool` thread, and a client's ``request_id`` labels its own call only (the
service keys every request by an id of its own), so no client can take another's.

A request's structured-output constraint is compiled on that same pool thread,
before ``submit``: one that does not compile is INVALID_ARGUMENT naming the proto's field
(``structured_outputs.regex``), and the engine thread finds the others compiled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shiftjax.serving.server import grpc_messages as messages
from shiftjax.serving.engine.errors import DeadlineExceeded, InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2_grpc as pb_grpc
from shiftjax.serving.server.protocol import FINISH_ERROR
from shiftjax.serving.server.tokenize_pool import TokenizePool, decode, encode
from shiftjax.serving.server.validation import DEFAULT_MAX_REQUEST_BYTES, bearer_token_matches

log = logging.getLogger("shiftjax.serving.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name  # shiftjax.v1.InferenceService
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
READINESS_POLL_SECONDS = 0.2


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place the service's errors become gRPC status codes."""
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)  # str names the field first
    if isinstance(error, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error) or "the waiting queue is full; retry later"
    if isinstance(error, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(error) or "the server is starting or shutting down"
    if isinstance(error, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    return grpc.StatusCode.INTERNAL, f"the request failed inside the server: {error}"


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """``service`` may be attached after the server starts (executables still compiling);
    until then, and once :meth:`drain` is called, Generate answers UNAVAILABLE."""

    def __init__(self, service=None, pool: TokenizePool | None = None):
        self.service = service
        self.pool = pool or TokenizePool()  # tokenizing and rendering, off the event loop
        self.draining = False
        self.active_generations = 0  # streams not yet closed; drain waits for them

    def drain(self) -> None:
        self.draining = True

    def _ready_service(self):
        if self.service is None:
            raise Unavailable("the server is starting: its executables are still compiling; retry shortly")
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new requests")
        return self.service

    async def Generate(self, request, context):
        deadline = messages.deadline_from(context.time_remaining())
        try:
            service = self._ready_service()
            label = messages.client_request_id(request)  # the client's own; the service's id is its key
            generation = await self.pool.run(_generation_request, service, request, deadline)
            stream = service.submit(generation)
        except Exception as error:  # refused before anything streamed
            await _abort(context, error)
        self.active_generations += 1
        try:
            async for delta in stream:
                if delta.finish_reason == FINISH_ERROR:
                    raise RequestFailed(f"request {label or delta.request_id} failed in the engine")
                yield messages.response_from(delta, label)
        except Exception as error:
            await _abort(context, error)
        finally:
            self.active_generations -= 1
            await stream.aclose()  # cancels the request if it is still running: pages freed now

    async def Tokenize(self, request, context):
        try:
            return await self.pool.run(_tokenize, self._tokenizer(), request)
        except Exception as error:
            await _abort(context, error)

    async def Detokenize(self, request, context):
        try:
            return await self.pool.run(_detokenize, self._tokenizer(), request)
        except Exception as error:
            await _abort(context, error)

    async def ServerInfo(self, request, context):
        if self.service is None:
            await _abort(context, Unavailable("the server is starting: its executables are still compiling"))
        try:
            info = self.service.info()
            if request.include_step_trace:
                info = {**info, "step_trace": self.service.step_trace()}
            return messages.server_info_from(info, self.service.stats())
        except Exception as error:
            await _abort(context, error)

    def _tokenizer(self):
        if self.service is None:  # tokenization needs no engine, but the tokenizer comes with it
            raise Unavailable("the server is starting; retry shortly")
        return self.service.tokenizer


def _generation_request(service, request: pb.GenerateRequest, deadline: float | None):
    """The service's request for ``request``, tokenized and its structured-output constraint
    compiled (carried to the engine thread in the request): CPU work, for one pool job."""
    generation = messages.generation_request_from(request, service.tokenizer, deadline)
    grammar = messages.check_structured_outputs(service, generation.params)
    return generation if grammar is None else dataclasses.replace(generation, grammar=grammar)


def _tokenize(tokenizer, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    if request.messages and request.text:
        raise InvalidRequest("messages", "give text or messages, not both")
    if request.messages:
        rendered = messages.render_chat(tokenizer, request.messages)
        return pb.TokenizeResponse(token_ids=encode(tokenizer, rendered, add_special_tokens=False),
                                   rendered_prompt=rendered)
    return pb.TokenizeResponse(token_ids=encode(tokenizer, request.text, request.add_special_tokens))


def _detokenize(tokenizer, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
    vocab_size = tokenizer.vocab_size
    for i, token in enumerate(request.token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequest("token_ids", f"token id {token} at position {i} is outside "
                                              f"the vocabulary [0, {vocab_size})")
    return pb.DetokenizeResponse(text=decode(tokenizer, request.token_ids, request.skip_special_tokens))


async def _abort(context, error: Exception):
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request failed: %s", error, exc_info=error)
    await context.abort(code, message)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED), except
    health checks: load balancers and orchestrators probe without credentials, and health
    reveals nothing but whether the server is serving. Reflection is guarded like the API."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization")
        if bearer_token_matches(given, self._token):  # HTTP's rule too
            return handler
        return _refusing(handler, "missing bearer token" if not given else "wrong bearer token")


class _Undecodable:
    """What the tolerant deserializer hands the handler for bytes that are not the message."""

    def __init__(self, error: Exception):
        self.error = error


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request message reached the handler as
    "Unexpected DecodeError", UNKNOWN, with a traceback logged; with a deserializer that
    hands the handler the failure instead, they are INVALID_ARGUMENT naming ``request``.
    Methods with streamed requests (reflection) keep grpc's own handling."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = handler.request_deserializer

        def tolerant(raw: bytes):
            try:
                return deserializer(raw)
            except Exception as error:  # google.protobuf.message.DecodeError, mostly
                return _Undecodable(error)

        async def refuse(request: _Undecodable, context):
            detail = str(request.error)[:200] or type(request.error).__name__
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: {detail} (the bytes sent to {method} are not its request message "
                                "in protobuf's wire format)")

        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if inspect.isasyncgenfunction(behavior):
            async def checked(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                async for response in behavior(request, context):
                    yield response
        else:
            async def checked(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                return await behavior(request, context)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return make(checked, request_deserializer=tolerant, response_serializer=handler.response_serializer)


def _refusing(handler, reason: str):
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{reason}: send metadata 'authorization: Bearer <token>' with the server's API key")

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class GrpcServer:
    """A grpc.aio server with the inference, health and reflection services.

    Health reports ``NOT_SERVING`` (for the empty service name and for
    ``shiftjax.v1.InferenceService``) until a service is attached and ready, and again
    from :meth:`drain` on.
    """

    def __init__(self, service=None, *, host: str = "127.0.0.1", port: int = 50051,
                 tls: tuple[bytes, bytes] | None = None, api_key: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_REQUEST_BYTES, pool: TokenizePool | None = None):
        # the bearer check first, so that it sees the tolerant deserializer's handler
        interceptors = ([BearerTokenInterceptor(api_key)] if api_key else []) + [UndecodableRequestInterceptor()]
        # grpc turns SO_REUSEPORT on by default, which lets a second server bind a port in use
        # and silently share its traffic; off, a busy port is an error at start. A message past
        # max_message_bytes (HTTP's body limit, --max-request-bytes) is RESOURCE_EXHAUSTED.
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message_bytes)])
        self.servicer = InferenceServicer(pool=pool)
        self.health = health.aio.HealthServicer()
        pb_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            cert_chain, private_key = tls
            self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(private_key, cert_chain)]))
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use, or not an address of this host)")
        self.address = f"{host}:{self.port}"
        self._watcher: asyncio.Task | None = None
        self._initial_service = service

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self._initial_service is not None:
            self.attach(self._initial_service)

    def attach(self, service) -> None:
        """Starts answering with ``service``; health turns SERVING once its stats say ready."""
        self.servicer.service = service
        self._watcher = asyncio.get_running_loop().create_task(self._watch_readiness(service))

    async def _watch_readiness(self, service) -> None:
        # Polled rather than pushed: the service reports readiness in stats(), nothing more.
        serving = None
        while not self.servicer.draining:
            stats = service.stats()
            now = stats.ready and not stats.draining
            if now != serving:
                serving = now
                await self._set_health(health_pb2.HealthCheckResponse.SERVING if now
                                       else health_pb2.HealthCheckResponse.NOT_SERVING)
            await asyncio.sleep(READINESS_POLL_SECONDS)

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def begin_drain(self) -> None:
        """Health NOT_SERVING and new Generate calls refused (UNAVAILABLE); the server keeps
        accepting calls, rather than ``server.stop(grace)`` at once, so that health checks
        see NOT_SERVING instead of a closed port."""
        self.servicer.drain()
        await self.health.enter_graceful_shutdown()
        if self._watcher is not None:
            self._watcher.cancel()

    async def wait_for_streams(self, seconds: float) -> int:
        """Waits up to ``seconds`` for every Generate stream to end; how many still run."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + seconds
        while self.servicer.active_generations and loop.time() < give_up:
            await asyncio.sleep(0.02)
        return self.servicer.active_generations

    async def drain(self, grace_seconds: float) -> None:
        """:meth:`begin_drain`, running calls given ``grace_seconds`` to finish, then the server
        stops, cancelling any still running (``shiftjax serve`` has the service end them with
        an abort first: serving/server/cli.py)."""
        await self.begin_drain()
        if left := await self.wait_for_streams(grace_seconds):
            log.warning("%d requests still running after %.1f s of grace; cancelling them", left, grace_seconds)
        await self.server.stop(0.5)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
