"""The engine as a service: requests in from any asyncio loop, deltas out, one engine thread.

The engine runs in its own thread (docs/architecture.md, "Life of a request"). ``submit`` validates a
request at once on the caller's thread, puts it in an inbox and returns an async iterator;
the engine thread takes the inbox, cancellations and expired deadlines *before* every
schedule (so an aborted request's pages are free for the very next step), runs a step,
turns its results into one :class:`Delta` per request (detokenized, stop strings applied,
by the output processor ``LLM.generate`` uses too: ``engine/output_processor.py``) and
hands each loop its deltas with one ``call_soon_threadsafe`` per step. The per-request
``asyncio.Queue`` needs no bound: the engine adds at most one delta per step per request.

With async scheduling (the engine's default) the thread launches step N+1 before it
waits for step N (N+1's decodes take N's tokens on the device); then, while the devices
run N+1, it commits N and makes N's deltas (detokenizing, stop strings, logprobs,
observer hooks) and sends them. A request that ends in N (a stop token, a stop string)
is in N+1 already: its token there is computed and dropped. Without async scheduling, N
is finished before N+1 is scheduled, and its deltas are made while N+1 runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable

from shiftjax.serving.engine.core import Engine, StepFailed, StepReport
from shiftjax.serving.engine.errors import DeadlineExceeded, InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.output_processor import OutputProcessor
from shiftjax.serving.engine.scheduler import Request
from shiftjax.serving.engine.stats import EngineSnapshot, describe
from shiftjax.serving.server.protocol import (
    FINISH_ABORT,
    FINISH_DEADLINE,
    FINISH_ERROR,
    Delta,
    GenerationRequest,
    ServiceStats,
)
from shiftjax.serving.server.live_request import LiveRequest, Outbox
from shiftjax.serving.server.request_ids import checked_request_id, new_request_id
from shiftjax.serving.server.service_info import StepTrace, service_info, service_stats
from shiftjax.serving.server.validation import validate_request

# A device error that outlives the engine's recovery (a CUDA context lost to an Xid, or the
# one-shot collectives' trap after the other GPU's step failed) fails every step after it:
# after this many failed steps in a row, none finished between them, the service stops
# reporting ready (health NOT_SERVING) and refuses new requests, so that an orchestrator
# restarts the server instead of sending it traffic it can only fail.
FAILED_STEPS_BEFORE_UNHEALTHY = 3

log = logging.getLogger(__name__)


class AsyncEngineService:
    """:class:`protocol.EngineService` over one :class:`Engine` driven by a thread.

    ``engine`` is an engine, or a function that builds one: it is then called on the
    engine thread, so a front end can answer health checks (not ready) while executables
    compile. ``max_waiting`` bounds the requests not yet running (default: the engine's
    ``max_queue``); ``observer``, an :class:`EngineObserver` (a Protocol, not checkable at
    run time, hence unannotated), receives metrics hooks on the engine thread.
    """

    def __init__(self, engine: Engine | Callable[[], Engine], tokenizer, *, model_name: str = "default",
                 observer=None, max_waiting: int | None = None,
                 details: dict | None = None):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.details = dict(details or {})  # extra JSON facts for info() (checkpoint path, ...)
        self._observer = observer
        self._max_waiting = max_waiting
        self._engine_factory = engine if callable(engine) and not isinstance(engine, Engine) else None
        self.engine: Engine | None = None if self._engine_factory else engine
        self._wake = threading.Condition()
        self._inbox: list[LiveRequest] = []
        self._cancels: list[LiveRequest] = []  # by object: an id may be reused once its request ends
        self._live: dict[str, LiveRequest] = {}
        self._by_request: dict[Request, LiveRequest] = {}
        self._ready = threading.Event()
        self._step_trace = StepTrace()
        self._startup_error: BaseException | None = None
        self._failed_steps = 0  # in a row, on the engine thread
        self._broken: str | None = None  # why the service gave up (FAILED_STEPS_BEFORE_UNHEALTHY)
        self._draining = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="shiftjax-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | int | None = None) -> bool:
        """Blocks until the engine is built; raises what building it raised."""
        ready = self._ready.wait(timeout)
        if self._startup_error is not None:
            raise RuntimeError(f"the engine failed to start: {self._startup_error}") from self._startup_error
        return ready

    @property
    def ready(self) -> bool:
        return self._started and self._broken is None

    @property
    def _started(self) -> bool:
        return self._ready.is_set() and self._startup_error is None

    def submit(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if self._broken is not None:
            raise Unavailable(self._broken)
        if self._draining or self._stopping:
            raise Unavailable("the server is shutting down and takes no new requests")
        if not self.ready:
            raise Unavailable("the engine is still starting (compiling its executables); retry shortly")
        validate_request(self.engine.limits, request)
        loop = asyncio.get_running_loop()
        with self._wake:
            waiting = len(self._inbox) + self.engine.snapshot().waiting
            limit = self._max_waiting or self.engine.limits.max_queue
            if waiting >= limit:
                raise Overloaded(f"the waiting queue is full ({limit} requests); retry later")
            request_id = checked_request_id(request.request_id) or new_request_id()  # unguessable: none stolen
            if request_id in self._live:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight; use a unique id")
            live = LiveRequest(request, request_id, loop)
            self._live[request_id] = live
            self._inbox.append(live)
            self._wake.notify()
        stream = live.stream(self._stream_closed)
        # Dropped unfinished, even never iterated, the request is cancelled: an async generator
        # that never started runs no ``finally`` when collected (a no-op once it has ended,
        # even if a new request has taken its id).
        weakref.finalize(stream, self._stream_closed, live)
        return stream

    def cancel(self, request_id: str) -> bool:
        with self._wake:
            live = self._live.get(request_id)
            if live is None or live.done:
                return False
            self._cancels.append(live)
            self._wake.notify()
            return True

    def _stream_closed(self, live: LiveRequest) -> None:
        """A stream closed before its end cancels its request, unless the request's deadline
        has passed: the engine's deadline check then ends it, in the same pass a cancel
        would, and names the cause. gRPC closes the stream for exactly that reason, its own
        clock firing at the same instant; on the tiny test model with 30 ms steps, 13 of 15
        expired gRPC calls reached the service as a close before the engine saw the deadline.
        (A finalizer may run this on a thread that holds ``_wake``: it is reentrant.)"""
        with self._wake:
            if self._live.get(live.request_id) is live and not live.done \
                    and not live.past_deadline(time.monotonic()):
                self._cancels.append(live)
                self._wake.notify()

    def stats(self) -> ServiceStats:
        started = self.engine is not None and self._started
        broken = self._broken  # read once: ready and error agree
        return service_stats(self.engine.snapshot() if started else None, inbox=len(self._inbox),
                             draining=self._draining, error=broken)

    def check_structured_outputs(self, params):
        """``params.structured_outputs`` compiled (None without one) on the calling thread: a
        front end calls this on a worker thread and sends the result as
        ``GenerationRequest.grammar``, so that the engine thread never compiles.
        :class:`InvalidRequest` naming ``structured_outputs.<kind>`` for one that does not."""
        if getattr(params, "structured_outputs", None) is None:
            return None
        if not self._started:
            raise Unavailable("the engine is still starting (compiling its executables); retry shortly")
        return self.engine.compile_grammar(params)

    def cached_prefix_tokens(self, prompt_ids, cache_salt: str | None = None) -> int:
        """Prompt tokens the engine's prefix cache holds now (0 while it starts): the
        data-parallel router's probe, from any thread (``Engine.cached_prefix_tokens``)."""
        return self.engine.cached_prefix_tokens(list(prompt_ids), cache_salt) if self._started else 0

    def info(self) -> dict:
        if not self._started:
            return {"model": self.model_name, "ready": False, **self.details}
        return service_info(describe(self.engine), self.model_name, self.stats()) | self.details

    async def drain(self, grace_seconds: float | int, cut_short: asyncio.Event | None = None) -> int:
        """Takes no new requests (:class:`Unavailable`), lets running ones finish for up to
        ``grace_seconds`` (or until ``cut_short`` is set), then aborts the rest; returns how
        many were aborted."""
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while self._live and time.monotonic() < deadline and not (cut_short and cut_short.is_set()):
            await asyncio.sleep(0.02)
        with self._wake:
            left = [live for live in self._live.values() if not live.done]
            self._cancels.extend(left)
            self._wake.notify()
        return len(left)

    def shutdown(self, timeout: float | int | None = 30.0) -> None:
        """Aborts whatever is in flight and stops the engine thread (idempotent)."""
        self._draining = True
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._engine_factory is not None:
            try:
                self.engine = self._engine_factory()
            except BaseException as error:  # reported by wait_ready(); the thread ends
                log.exception("engine start-up failed")
                self._startup_error = error
                self._ready.set()
                return
        self._ready.set()
        started = describe(self.engine)
        self._observe("on_startup", compile_seconds=started.compile_seconds, executables=started.executables,
                      cache_hits=started.cache_hits)
        # Each pass takes admissions and cancellations, then one turn of the engine's step
        # pipeline: with async scheduling it launches step N+1 before it finishes N, so the
        # deltas of N are made while the devices run N+1.
        while True:
            with self._wake:
                while not (self.engine.has_step_in_flight or self._inbox or self._cancels or self._stopping
                           or self.engine.has_work):
                    self._wake.wait(self._seconds_to_next_deadline())
                    if self._expired():
                        break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stopping = self._stopping
            outgoing = Outbox()
            try:
                if stopping:
                    for live in list(self._live.values()):
                        self._end(live, FINISH_ABORT, outgoing)
                else:
                    self._take(inbox, cancels, outgoing)
                    self._turn(outgoing)
            except Exception as error:  # a bug of ours, or the devices: fail what is in flight
                log.exception("engine loop failed; failing the requests in flight")
                self.engine.forget_in_flight()
                for live in list(self._live.values()):
                    self._fail(live, outgoing)
                self._step_failed(error)
            outgoing.send()
            if stopping:
                return

    def _seconds_to_next_deadline(self) -> float | None:
        deadlines = [live.request.deadline for live in self._live.values() if live.request.deadline is not None]
        return None if not deadlines else max(min(deadlines) - time.monotonic(), 0.0) + 1e-3

    def _expired(self) -> bool:
        now = time.monotonic()
        return any(live.past_deadline(now) for live in self._live.values())

    def _take(self, inbox: list[LiveRequest], cancels: list[LiveRequest], outgoing: Outbox) -> None:
        """Admissions, then cancellations, then expired deadlines, before the next schedule:
        a cancel or drain taken in the same pass as an expiry it came after is still an abort,
        since the caller asked for that end (:meth:`cancel`)."""
        for live in inbox:
            if live.done:
                continue
            try:
                params = live.request.params
                live.engine_request = self.engine.add_request(list(live.request.prompt_ids), params,
                                                              live.request.cache_salt, live.request.grammar)
                live.output = OutputProcessor(self.tokenizer, params)
                self._by_request[live.engine_request] = live
            except Exception as error:  # validated already; a race with the queue bound
                log.warning("request %s refused at admission: %s", live.request_id, error)
                self._fail(live, outgoing, Overloaded(str(error)))
        for live in cancels:
            if self._live.get(live.request_id) is live:
                self._end(live, FINISH_ABORT, outgoing)
        now = time.monotonic()
        for live in list(self._live.values()):
            if live.past_deadline(now):
                self._expire(live, outgoing)

    def _turn(self, outgoing: Outbox) -> None:
        """One turn of the engine's pipeline, and its bookkeeping: preemptions, first
        schedule times, the step's metrics and trace, failed requests, then the deltas."""
        if not (self.engine.has_step_in_flight or self.engine.has_work):
            return
        preemptions = self.engine.snapshot().preemptions
        turn = self.engine.step()
        after = self.engine.snapshot()
        for _ in range(after.preemptions - preemptions):
            self._observe("on_preemption")
        if turn is None:
            return
        now = time.monotonic()
        for launched in turn.launched:
            for request in launched.scheduled.requests:
                live = self._by_request.get(request)
                if live is not None and live.first_scheduled is None:
                    live.first_scheduled = now
        report = turn.finished
        if report is not None:
            self._failed_steps = 0
            self._record(report, after)
            self._make_deltas(report, outgoing)  # first: a request the failed launch fails keeps these
        for failure in turn.failed:
            self._fail_step(failure, outgoing)
        if turn.failed:  # once a turn: a failed finish and the launch that read it are one incident
            last = turn.failed[-1]
            self._step_failed(last.__cause__ or last)

    def _step_failed(self, error: BaseException) -> None:
        """Counts a turn that failed (a step's launch or result, or the loop itself); the
        ``FAILED_STEPS_BEFORE_UNHEALTHY``-th in a row, no step finished between them, makes
        the service unhealthy (it stays up, to answer health checks and drain)."""
        self._failed_steps += 1
        if self._failed_steps >= FAILED_STEPS_BEFORE_UNHEALTHY and self._broken is None:
            self._broken = (f"the engine failed {self._failed_steps} steps in a row (the last: "
                            f"{type(error).__name__}: {str(error)[:200]}); the devices may be unusable: "
                            f"restart the server")
            log.critical("%s; health NOT_SERVING, new requests refused", self._broken)

    def _record(self, report: StepReport, engine: EngineSnapshot) -> None:
        """The step's metrics and its line in the step trace (``engine`` as the step left it)."""
        self._observe("on_step", mode=report.mode, num_tokens=report.num_tokens, num_seqs=len(report.requests),
                      seconds=report.seconds, switched=report.switched)
        self._step_trace.append({"time": time.time(), "mode": report.mode, "num_tokens": report.num_tokens,
                                 "num_seqs": len(report.requests), "running": engine.running,
                                 "waiting": engine.waiting + len(self._inbox), "seconds": report.seconds})

    def step_trace(self) -> list[dict]:
        """The last steps (``service_info.StepTrace``), oldest first: Unix ``time`` at the
        step's end, ``mode``, ``num_tokens``, ``num_seqs``, ``running``, ``waiting``, ``seconds``."""
        return self._step_trace.steps()

    def _fail_step(self, failure: StepFailed, outgoing: Outbox) -> None:
        log.error("a step failed; failing its %d requests", len(failure.requests), exc_info=failure)
        for request in failure.requests:
            live = self._by_request.get(request)
            if live is not None:
                self._fail(live, outgoing)

    def _make_deltas(self, report: StepReport, outgoing: Outbox) -> None:
        now = time.monotonic()
        for request, sampled in zip(report.requests, report.sampled):
            live = self._by_request.get(request)
            if live is None or live.done or not sampled:
                continue
            try:
                self._emit(live, request, now, outgoing)
            except Exception:  # this request alone fails (say, its detokenizer)
                log.exception("request %s failed", live.request_id)
                self._fail(live, outgoing)

    def _emit(self, live: LiveRequest, request: Request, now: float, outgoing: Outbox) -> None:
        delta, output = live.next_delta(request)
        for first, seconds in live.token_arrivals(len(delta.token_ids), now):
            self._observe("on_token", first=first, seconds_since_previous=seconds)
        if output.finish_reason is None:
            outgoing.put(live, delta)
        else:
            self._end(live, output.finish_reason, outgoing, delta, output.stop_reason)

    def _end(self, live: LiveRequest, reason: str, outgoing: Outbox, delta: Delta | None = None,
             stop_reason: int | str | None = None) -> None:
        """Finishes a request: frees its pages now, streams the last delta with usage."""
        self._forget(live, reason)
        usage = live.usage()
        delta = delta or Delta(live.request_id)
        outgoing.put(live, Delta(delta.request_id, delta.token_ids, delta.text, delta.logprobs,
                                 finish_reason=reason, stop_reason=stop_reason, usage=usage))
        self._observe("on_finish", usage=usage, finish_reason=reason)

    def _fail(self, live: LiveRequest, outgoing: Outbox, error: Exception | None = None) -> None:
        if live.done:
            return
        self._forget(live, FINISH_ERROR)
        outgoing.put(live, error or RequestFailed(f"request {live.request_id} failed inside the engine; "
                                                  f"see the server log"))
        self._observe("on_finish", usage=live.usage(), finish_reason=FINISH_ERROR)

    def _expire(self, live: LiveRequest, outgoing: Outbox) -> None:
        """Ends a request whose deadline passed: pages freed now, its stream raises."""
        self._forget(live, FINISH_DEADLINE)
        outgoing.put(live, DeadlineExceeded(
            f"request {live.request_id} passed its deadline after {live.sent} of "
            f"{live.request.params.max_tokens} output tokens; allow more time or ask for fewer tokens"))
        self._observe("on_finish", usage=live.usage(), finish_reason=FINISH_DEADLINE)

    def _forget(self, live: LiveRequest, reason: str) -> None:
        live.done = True
        request = live.engine_request
        if request is not None:
            if not request.finished or request.pages:
                self.engine.abort(request, reason)
            self._by_request.pop(request, None)
        with self._wake:
            self._live.pop(live.request_id, None)

    def _observe(self, hook: str, **values) -> None:
        """Calls an observer hook; a failing observer is logged, never fails a request."""
        if self._observer is None:
            return
        try:
            getattr(self._observer, hook)(**values)
        except Exception:
            log.exception("observer %s failed", hook)

