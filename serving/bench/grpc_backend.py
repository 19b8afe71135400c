"""The ``grpc`` bench backend: the ``shiftjax.v1`` ``Generate`` stream over ``grpc.aio``.

Prompts go as ``prompt_ids``, with ``max_tokens`` the output length and ``ignore_eos``.
Every response carrying token ids is one output chunk (TTFT, then ITL gaps); the token
count, the mode of every step and the prompt tokens the prefix cache had
(``cached_prompt_tokens``) come from the last response's ``usage``. A run's ``cache_salt``
goes with every request, and so does ``disable_speculation`` when the run asks for it; the
server's speculative decoding counters are ``ServerInfo.speculative``.
"""

from __future__ import annotations

import time

import grpc

from shiftjax.serving.bench.metrics import RequestRecord, StreamClock
from shiftjax.serving.bench.speculation import SpeculationReading, reading_from_server_info
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2, inference_pb2_grpc

# Large prompts (the Azure code trace reaches 7.4k tokens, 8 bytes each on the wire at
# worst) stay far below this, but gRPC's 4 MiB default would refuse a 500k-token prompt.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class GrpcBackend:
    """One channel for the whole run (gRPC multiplexes the streams over it)."""

    name = "grpc"

    def __init__(self, server: str, *, api_key: str | None = None, cache_salt: str | None = None,
                 json_schema: str | None = None, disable_speculation: bool = False):
        self.server = server
        self.cache_salt = cache_salt or ""
        self.json_schema = json_schema
        self.disable_speculation = disable_speculation
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: inference_pb2_grpc.InferenceServiceStub | None = None

    async def __aenter__(self) -> "GrpcBackend":
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.aio.insecure_channel(self.server, options=options)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()

    async def server_info(self) -> dict:
        """ServerInfo as a dict (protobuf field names), for the result file."""
        from google.protobuf.json_format import MessageToDict

        reply = await self._stub.ServerInfo(inference_pb2.ServerInfoRequest(), metadata=self._metadata)
        return MessageToDict(reply, preserving_proto_field_name=True)

    async def speculation(self) -> SpeculationReading | None:
        """The server's speculative decoding now (None from a server that does not say)."""
        reply = await self._stub.ServerInfo(inference_pb2.ServerInfoRequest(), metadata=self._metadata)
        return reading_from_server_info(reply)

    async def generate(self, record: RequestRecord, prompt_ids: list[int], clock=time.perf_counter, *,
                       keep_output_ids: bool = False) -> None:
        """Sends one request and fills ``record`` with what its stream showed (and the
        answer's token ids in ``record.output_ids`` with ``keep_output_ids``)."""
        request = inference_pb2.GenerateRequest(
            prompt_ids=prompt_ids, max_tokens=record.output_len, ignore_eos=True, temperature=0.0,
            cache_salt=self.cache_salt, disable_speculation=self.disable_speculation,
        )
        if self.json_schema is not None:
            request.structured_outputs.json_schema = self.json_schema
        timer = StreamClock(record, clock)
        usage = None
        output_ids = []
        try:
            async for response in self._stub.Generate(request, metadata=self._metadata):
                if response.token_ids:
                    timer.output_chunk(len(response.token_ids))
                    if keep_output_ids:
                        output_ids.extend(response.token_ids)
                if response.HasField("usage"):
                    usage = response.usage
            if keep_output_ids:
                record.output_ids = output_ids
            if usage is not None:
                record.modes = list(usage.modes)
                record.cached_tokens = usage.cached_prompt_tokens
                record.server_usage = {
                    "prompt_tokens": usage.prompt_tokens, "output_tokens": usage.output_tokens,
                    "queue_seconds": usage.queue_seconds, "ttft_seconds": usage.ttft_seconds,
                    "e2e_seconds": usage.e2e_seconds, "preemptions": usage.preemptions,
                    "cached_prompt_tokens": usage.cached_prompt_tokens,
                }
            timer.finish(usage.output_tokens if usage is not None else None)
        except grpc.aio.AioRpcError as error:
            record.success = False
            record.error = f"{error.code().name}: {error.details()}"
