"""A stand-in server for testing the bench: no model, fixed delays, both protocols.

It speaks the real wire formats (``shiftjax.v1.InferenceService`` with the standard health
service over gRPC, streamed ``/v1/completions`` over HTTP) and answers every request with
``max_tokens`` tokens: the first after ``prefill_delay``, the others ``token_delay``
apart. Each token's step is labelled ``sp`` while at least ``sp_from`` requests are in
flight, else ``tp``, and the server keeps a step trace in ``ServerInfo.info_json``
(``step_trace``) the way the real server is asked to, so ``bench compare``'s plots can be
tested. What it records (prompts, salts, peak concurrency) lets tests check what the bench
sent. Its answers depend on the prompt, so a chat's turns can be told apart. With
``cache_block_size`` it plays an infinite prefix cache of full blocks, one per
``cache_salt``, and reports the prompt tokens it had (``cached_prompt_tokens``,
``prompt_tokens_details.cached_tokens``).

Run ``python -m shiftjax.serving.bench.fake_server --port P [--http-port H]``; it exits 0
on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2_grpc as pb_grpc


class FakeEngine:
    """The timing and bookkeeping both front ends share."""

    def __init__(self, *, prefill_delay: float = 0.02, token_delay: float = 0.01, sp_from: int = 4,
                 report_step_trace: bool = True, cache_block_size: int | None = None,
                 http_token_ids: bool = True):
        self.prefill_delay = prefill_delay
        self.token_delay = token_delay
        self.sp_from = sp_from
        self.report_step_trace = report_step_trace  # off: ServerInfo has only counters, as today's server
        self.in_flight = 0
        self.peak_in_flight = 0
        self.requests: list[dict] = []  # what each request asked for
        self.step_trace: list[dict] = []
        self.cache_block_size = cache_block_size
        self.http_token_ids = http_token_ids  # off: no choices[].token_ids, as an OpenAI server without the extension
        self._cached_blocks: set[tuple] = set()  # (salt, the prompt up to a block's end)

    def cached_tokens(self, prompt_ids: list[int], salt: str) -> int:
        """The leading full blocks of the prompt but its last token seen before (under this
        salt), in tokens, as a paged server's prefix cache finds them (the last token is
        always computed); the prompt's full blocks are cached from now on, and the answer's
        when it is out (:meth:`tokens`)."""
        if not self.cache_block_size:
            return 0
        hit, looked_up = 0, prompt_ids[:-1]
        for end in range(self.cache_block_size, len(looked_up) + 1, self.cache_block_size):
            if (salt, tuple(looked_up[:end])) not in self._cached_blocks:
                break
            hit = end
        self._remember(prompt_ids, salt)
        return hit

    def _remember(self, token_ids: list[int], salt: str) -> None:
        if self.cache_block_size:
            for end in range(self.cache_block_size, len(token_ids) + 1, self.cache_block_size):
                self._cached_blocks.add((salt, tuple(token_ids[:end])))

    async def tokens(self, prompt_ids: list[int], max_tokens: int, salt: str = ""):
        """Yields ``(token_id, mode)`` on the schedule; returns when ``max_tokens`` are out.
        The ids are ``1000 + (len(prompt) + i) % 1000``: a different answer for each turn."""
        self.requests.append({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens, "cache_salt": salt})
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        answer = []
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.prefill_delay if i == 0 else self.token_delay)
                mode = "sp" if self.in_flight >= self.sp_from else "tp"
                self.step_trace.append({"time": time.time(), "mode": mode, "running": self.in_flight,
                                        "waiting": 0, "num_tokens": len(prompt_ids) if i == 0 else 1})
                answer.append(1000 + (len(prompt_ids) + i) % 1000)
                yield answer[-1], mode
        finally:
            self.in_flight -= 1
            self._remember(list(prompt_ids) + answer, salt)


class FakeInferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine: FakeEngine):
        self.engine = engine

    async def Generate(self, request, context):
        if not request.prompt_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: the fake server takes token ids")
        start, modes, first = time.monotonic(), [], None
        prompt = list(request.prompt_ids)
        cached = self.engine.cached_tokens(prompt, request.cache_salt)
        async for token, mode in self.engine.tokens(prompt, request.max_tokens or 64, request.cache_salt):
            first = first or time.monotonic()
            modes.append(mode)
            yield pb.GenerateResponse(request_id="fake", token_ids=[token], text="x")
        usage = pb.Usage(prompt_tokens=len(prompt), output_tokens=len(modes), queue_seconds=0.0,
                         ttft_seconds=(first or start) - start, e2e_seconds=time.monotonic() - start, modes=modes,
                         cached_prompt_tokens=cached)
        yield pb.GenerateResponse(request_id="fake", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)

    async def ServerInfo(self, request, context):
        trace = self.engine.step_trace
        steps_by_mode = {mode: sum(s["mode"] == mode for s in trace) for mode in ("tp", "sp")}
        info = {"step_trace": trace} if self.engine.report_step_trace else {}
        return pb.ServerInfoResponse(model="fake", modes=["tp", "sp"], policy="fake", ready=True,
                                     running=self.engine.in_flight, waiting=0, steps=len(trace),
                                     steps_by_mode=steps_by_mode, info_json=json.dumps(info))


def completions_app(engine: FakeEngine):
    """A bare ASGI app: ``GET /v1/models`` and streamed ``POST /v1/completions``."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            return await _send_json(send, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        if scope["path"] != "/v1/completions" or scope["method"] != "POST":
            return await _send_json(send, {"error": "not found"}, status=404)
        payload = json.loads(body)
        if not payload.get("ignore_eos") or not isinstance(payload.get("prompt"), list):
            return await _send_json(send, {"error": "the fake takes token-id prompts with ignore_eos"}, status=400)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        modes, salt = [], payload.get("cache_salt") or ""
        cached = engine.cached_tokens(payload["prompt"], salt)
        async for token, mode in engine.tokens(payload["prompt"], payload["max_tokens"], salt):
            modes.append(mode)
            choice = {"index": 0, "text": "x", "finish_reason": None}
            await _send_event(send, {"choices": [choice | ({"token_ids": [token]} if payload.get("return_token_ids")
                                                           and engine.http_token_ids
                                                           else {})]})
        await _send_event(send, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": len(modes), "modes": modes,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await _send_event(send, {"choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


async def _send_json(send, obj, status=200):
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


async def _send_event(send, obj):
    await send({"type": "http.response.body", "body": f"data: {json.dumps(obj)}\n\n".encode(), "more_body": True})


class FakeServer:
    """Both front ends on loopback; ``port=0`` picks a free gRPC port (see ``grpc_port``)."""

    def __init__(self, engine: FakeEngine | None = None, *, port: int = 0, http_port: int | None = None,
                 startup_delay: float = 0.0):
        self.engine = engine or FakeEngine()
        self.port, self.http_port, self.startup_delay = port, http_port, startup_delay
        self.grpc_port = None
        self._grpc = None
        self._http = None
        self._http_task = None

    async def start(self) -> None:
        import uvicorn

        self._grpc = grpc.aio.server()
        pb_grpc.add_InferenceServiceServicer_to_server(FakeInferenceServicer(self.engine), self._grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._grpc.start()
        if self.http_port is not None:
            config = uvicorn.Config(completions_app(self.engine), host="127.0.0.1", port=self.http_port,
                                    log_level="warning", lifespan="off")
            self._http = uvicorn.Server(config)
            self._http_task = asyncio.create_task(self._http.serve())
            while not self._http.started:
                await asyncio.sleep(0.01)
        await asyncio.sleep(self.startup_delay)  # a real server compiles here
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
            await self._http_task
        await self._grpc.stop(grace=1.0)


def fake_server_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shiftjax.serving.bench.fake_server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument("--prefill-delay", type=float, default=0.02)
    parser.add_argument("--token-delay", type=float, default=0.01)
    parser.add_argument("--sp-from", type=int, default=4)
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument("--no-step-trace", action="store_true", help="ServerInfo without info_json's step_trace")
    parser.add_argument("--cache-block-size", type=int, default=None, help="play a prefix cache of blocks this long")
    args = parser.parse_args(argv)

    async def serve():
        engine = FakeEngine(prefill_delay=args.prefill_delay, token_delay=args.token_delay, sp_from=args.sp_from,
                            report_step_trace=not args.no_step_trace, cache_block_size=args.cache_block_size)
        server = FakeServer(engine, port=args.port, http_port=args.http_port, startup_delay=args.startup_delay)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        await stop.wait()
        await server.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(fake_server_main())
