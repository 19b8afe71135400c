"""A deterministic fake EngineService and a gRPC server in a thread: the front ends
tested without a model.

Output token ``i`` of a prompt is ``(sum(prompt_ids) + i) % 1000 + 1000``, one token per
step of ``step_seconds``; each live request holds its pages (prompt plus max_tokens, 16
tokens a page) from submit until its stream ends or is closed, so a leak shows in
``stats().engine.free_pages``. ``fail_on_prompt`` makes a request fail mid-stream (RequestFailed).
As the real service, a cancel ends the stream with an abort, even after the deadline, and
an expired deadline raises DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from shiftjax.serving.engine.errors import DeadlineExceeded, InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.stats import EngineSnapshot
from shiftjax.serving.server.protocol import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Delta, GenerationRequest,
                                       ServiceStats, TokenLogprob, Usage, prompt_ids_or_error)

PAGE_SIZE = 16


def with_engine(stats: ServiceStats, **fields) -> ServiceStats:
    """``stats`` with those fields of its engine snapshot replaced."""
    return dataclasses.replace(stats, engine=dataclasses.replace(stats.engine, **fields))


def expected_output(prompt_ids, max_tokens: int) -> list[int]:
    return [(sum(prompt_ids) + i) % 1000 + 1000 for i in range(max_tokens)]


class FakeEngineService:
    def __init__(self, tokenizer, *, num_pages: int = 256, max_model_len: int = 512, max_running: int = 64,
                 step_seconds: float = 0.002, fail_on_prompt: tuple[int, ...] | None = None):
        self.tokenizer = tokenizer
        self.num_pages, self.max_model_len, self.max_running = num_pages, max_model_len, max_running
        self.step_seconds = step_seconds
        self.fail_on_prompt = fail_on_prompt
        self.free_pages = num_pages
        self.live: dict[str, _FakeStream] = {}
        self.ready, self.draining = True, False
        self.submitted: list[GenerationRequest] = []
        self.steps: list[dict] = []  # what step_trace() returns; the fake runs no steps of its own
        self._ids = itertools.count()

    def submit(self, request: GenerationRequest) -> "_FakeStream":
        if self.draining or not self.ready:
            raise Unavailable("draining")
        prompt = prompt_ids_or_error(request.prompt_ids, self.tokenizer.vocab_size)
        if len(prompt) + request.params.max_tokens > self.max_model_len:
            raise InvalidRequest("max_tokens", f"prompt ({len(prompt)}) plus max_tokens exceeds {self.max_model_len}")
        if len(self.live) >= self.max_running:
            raise Overloaded("the waiting queue is full")
        pages = -(-(len(prompt) + request.params.max_tokens) // PAGE_SIZE)
        self.free_pages -= pages
        request_id = request.request_id or f"fake-{next(self._ids)}"
        stream = _FakeStream(self, request, request_id, pages)
        self.live[request_id] = stream
        self.submitted.append(request)
        return stream

    def cancel(self, request_id: str) -> bool:
        stream = self.live.get(request_id)
        if stream is None:
            return False
        stream.cancelled = True
        return True

    def step_trace(self) -> list[dict]:
        return list(self.steps)

    def release(self, stream: "_FakeStream") -> None:
        if self.live.pop(stream.request_id, None) is not None:
            self.free_pages += stream.pages

    def stats(self) -> ServiceStats:
        engine = EngineSnapshot(running=len(self.live), num_pages=self.num_pages, free_pages=self.free_pages,
                                tokens_by_mode={"tp": 0}, steps_by_mode={"tp": 0})
        return ServiceStats(engine, ready=self.ready, draining=self.draining)

    def info(self) -> dict:
        """Laid out as serving/server/service_info.py lays out the real service's."""
        return {"model": "fake", "modes": ["tp", "sp"], "mesh": {"sp": 2, "tp": 2, "axes": ["sp", "tp"]},
                "buckets": {"tokens": [16, 64], "seqs": [4]},
                "page_pool": {"num_pages": self.num_pages, "free_pages": self.free_pages, "page_size": PAGE_SIZE},
                "policy": {"name": "auto", "threshold": None,
                           "timing": [{"mode": "tp", "tokens": 16, "seqs": 4, "seconds": 0.01},
                                      {"mode": "sp", "tokens": 64, "seqs": 4, "seconds": 0.02}]},
                "startup": {"executables": 4, "compile_seconds": 1.5, "cache_hits": 0},
                "limits": {"max_model_len": self.max_model_len}}


class _FakeStream:
    """What submit returns: an async iterator whose aclose() cancels and frees at once,
    even before the first delta (as the real service's must)."""

    def __init__(self, service, request, request_id, pages):
        self.service, self.request, self.request_id, self.pages = service, request, request_id, pages
        self.cancelled = False
        self.sent = 0
        self.started = time.monotonic()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finished:
            raise StopAsyncIteration
        params = self.request.params
        await asyncio.sleep(self.service.step_seconds)
        deadline = self.request.deadline
        if self.cancelled:
            return self._finish((), FINISH_ABORT)
        if deadline is not None and time.monotonic() > deadline:
            self.service.release(self)
            self.finished = True
            raise DeadlineExceeded(f"request {self.request_id} passed its deadline")
        if self.service.fail_on_prompt == tuple(self.request.prompt_ids) and self.sent == 2:
            self.service.release(self)
            self.finished = True
            raise RequestFailed("injected failure")
        token = expected_output(self.request.prompt_ids, self.sent + 1)[-1]
        self.sent += 1
        stop = token in params.stop_token_ids
        if stop or self.sent == params.max_tokens:
            return self._finish((token,), FINISH_STOP if stop else FINISH_LENGTH, token if stop else None)
        return self._delta((token,))

    def _delta(self, tokens, **fields) -> Delta:
        logprobs = tuple(TokenLogprob(t, -0.5, tuple((t + k, -1.0 - k) for k in range(self.request.params.top_logprobs)))
                         for t in tokens) if self.request.params.logprobs else ()
        return Delta(self.request_id, token_ids=tuple(tokens), text=self.service.tokenizer.decode(tokens),
                     logprobs=logprobs, **fields)

    def _finish(self, tokens, reason, stop_reason=None) -> Delta:
        self.finished = True
        self.service.release(self)
        elapsed = time.monotonic() - self.started
        usage = Usage(prompt_tokens=len(self.request.prompt_ids), output_tokens=self.sent, queue_seconds=0.0,
                      ttft_seconds=elapsed, e2e_seconds=elapsed, modes=("tp",) * self.sent)
        return self._delta(tokens, finish_reason=reason, stop_reason=stop_reason, usage=usage)

    async def aclose(self) -> None:
        self.finished = True
        self.service.release(self)


class ServerThread:
    """A :class:`GrpcServer` on its own event loop in a daemon thread, on a free loopback
    port, so that tests can use the blocking :class:`Client` against it."""

    def __init__(self, service=None, **server_options):
        import threading

        from shiftjax.serving.server.grpc_server import GrpcServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make():
            server = GrpcServer(service, host="127.0.0.1", port=0, **server_options)
            await server.start()
            return server

        self.server = self.run(make())
        self.address = self.server.address

    def run(self, coroutine, timeout: float = 60):
        """Runs ``coroutine`` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def call_soon(self, function, *args):
        self.loop.call_soon_threadsafe(function, *args)

    def stop(self) -> None:
        self.run(self.server.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def self_signed_certificate(folder) -> tuple[bytes, bytes]:
    """A self-signed certificate for localhost and 127.0.0.1 in ``folder`` (``cert.pem``,
    ``key.pem``), as PEM bytes (the openssl CLI: the cryptography package is not installed
    here). Both front ends take it: gRPC as bytes, uvicorn as the files."""
    import subprocess

    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert.read_bytes(), key.read_bytes()


def serving_client(address: str, timeout: float = 30.0):
    """A blocking :class:`Client` of ``address``, returned once health says SERVING (use it
    as a context manager)."""
    from shiftjax.serving.client.grpc_client import Client

    client = Client(address, timeout=timeout)
    client.wait_until_serving(10.0, poll_seconds=0.05)
    return client
