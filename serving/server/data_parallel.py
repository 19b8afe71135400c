"""Data parallelism behind one endpoint: P engine services of one device each, one
:class:`protocol.EngineService` in front of them (``shiftjax serve --dp P``).

DP is the baseline the project measures Shift against (docs/architecture.md):
each replica holds the whole model on its own device, its own page pool, prefix cache and
scheduler; nothing is shared between replicas but the tokenizer and the front ends.
:class:`DataParallelService` routes each request to the replica with the fewest *queued
tokens* once the request is placed there, its cached prefix not counted, and otherwise only
forwards (stream, cancel) and sums (stats).

Queued tokens of a replica: for each request routed to it and not yet finished, its
prompt tokens until its first output token arrives (the prefill still owed), plus
``max_tokens`` minus the tokens already streamed (the decode still owed). Both kinds are
what the scheduler's per-step token budget is spent on, so the sum is the budget a
replica must still spend on work it already has; requests of very different lengths
weigh what they cost, which counting requests would not. The remaining decode is an upper
bound (EOS may come sooner); a preempted request's recompute is not seen. The figure is
kept here, on the caller's loop, from what was routed and what has streamed back, not
read from the engines' schedulers: those belong to the engine threads (reading their
deques from another thread can fail mid-mutation), and the requests still in a replica's
inbox, which no scheduler has seen yet, are exactly the ones a burst of submits must see.
Ties go to the replica with fewer live requests, then to the lower index.

Prefix-aware routing: each replica's engine is asked how many of the request's prompt
tokens its prefix cache holds (``cached_prefix_tokens``, a read-only probe from this
thread while the engine thread runs: a stale answer only routes worse), and those tokens
are taken off what the request would owe there. So among replicas equally loaded the one
holding the longest prefix wins, and a replica holding none is chosen by queued tokens as
before; a replica that holds the prefix but is busier by more than the prefix saves loses
it, so a prefix every request shares (a chat template's system prompt) cannot draw all
traffic to one replica, as a strict longest-prefix rule would. (SGLang's cache-aware
router guards the same failure with a load-imbalance threshold instead.) A replica that
cannot answer the probe (no ``cached_prefix_tokens``) is counted as holding nothing.

Why one process rather than P server processes behind a router: one tokenizer, one port,
the same front ends (gRPC, HTTP, metrics, health, drain) over one more ``EngineService``,
no inter-process hop for every streamed delta, and the router sees each delta as it
passes, so its token counts cost nothing to keep. The risk is the GIL: every engine's
host work (schedule, pad, place the batch, dispatch, unpack, detokenize) runs in one
interpreter; only XLA's execution and the wait for a step's result release it. Measured
on 2026-11-29 (benchmarks/README.md, "CPU"; this 2-core CPU shared with other work, load
average about 15; each replica its own virtual CPU device; 8 requests of 24 prompt and 48
output tokens per replica):

- The default model, steps device-bound: host time per step 1.16 ms at P=1, 1.33 ms at
  P=4 in threads (1.05 ms at P=4 in processes), against 361 ms (P=1) to 2.1 s (P=4) of
  XLA per step; 3.97 of the 4 replicas' steps in flight on average. Here the GIL does not
  serialise anything; the CPU devices' compute, which shares the two cores, is what does
  not scale (13.9 tokens/s in threads, 11.0 in processes, 20.8 at P=1).
- A 2-layer random Llama, steps host-bound (the GIL's worst case): host time per step
  0.51 to 0.53 ms at P=1, 0.80 to 1.08 ms at P=4 in threads, 0.68 to 0.80 ms in
  processes; but P=4 throughput was 2.5k to 8.2k tokens/s in threads over six runs (3.0k
  to 3.6k at P=1) against a steady 6.5k to 9.1k in processes over five: the engines'
  Python contending for the GIL. ``sys.setswitchinterval(0.0002)`` did not help
  consistently.

So one process is right while steps are device-bound: the bound is P x host time per
step < step time. On 2x H200 the engine loop's host time per decode step is of the order of
the device's (benchmarks/README.md, "Async scheduling and the two uploads"), so even two replicas in threads
may contend; processes were not measured on the GPUs. For a small model with host-bound
steps, P processes would serve up to 3x more; a replica here is any ``EngineService``,
so a proxy to a ``shiftjax serve`` process behind this same router is the way there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence

from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, Unavailable
from shiftjax.serving.server.protocol import Delta, GenerationRequest, ServiceStats
from shiftjax.serving.server.request_ids import checked_request_id, new_request_id
from shiftjax.serving.server.service_info import (
    max_by_key,
    prefix_cache_info,
    replica_errors,
    speculative_counts,
    structured_outputs_info,
    summed_stats,
)
from shiftjax.serving.server.validation import checked_cache_salt


@dataclasses.dataclass(eq=False)
class RoutedLoad:
    """A request in flight on one replica, and the tokens it still owes there: what the
    router counts (also the simulator's, serving/bench/simulate.py)."""

    replica: int  # -1: not placed yet
    prompt_tokens: int  # until the first output token: the prefill still to run
    output_tokens_left: int

    @property
    def queued_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens_left

    def streamed(self, tokens: int, finished: bool) -> None:
        """``tokens`` came back: the first ends the prefill; a finished request owes nothing."""
        if tokens:
            self.prompt_tokens = 0
            self.output_tokens_left = max(self.output_tokens_left - tokens, 0)
        if finished:
            self.prompt_tokens = self.output_tokens_left = 0


def replica_loads(routes: Iterable[RoutedLoad], replicas: int) -> tuple[list[int], list[int]]:
    """Per replica: queued tokens and live requests, in one pass over the routes."""
    queued, live = [0] * replicas, [0] * replicas
    for routed in routes:
        if routed.replica >= 0:
            queued[routed.replica] += routed.queued_tokens
            live[routed.replica] += 1
    return queued, live


def pick_replica(queued_tokens: Sequence[int], live_requests: Sequence[int],
                 candidates: Sequence[int] | None = None, cached_tokens: Sequence[int] | None = None) -> int:
    """The index of the replica with the fewest queued tokens among ``candidates`` (default
    all), less the request's prompt tokens its prefix cache holds (``cached_tokens``, default
    none); ties to fewer live requests, then to the lower index."""
    indices = range(len(queued_tokens)) if candidates is None else candidates
    cached = cached_tokens or [0] * len(queued_tokens)
    return min(indices, key=lambda i: (queued_tokens[i] - cached[i], live_requests[i], i))


class DataParallelService:
    """:class:`protocol.EngineService` over ``replicas``, each an engine service of its own
    (normally an :class:`AsyncEngineService` on one device; ``Sequence[EngineService]``,
    unannotated since a Protocol cannot be checked at run time). ``devices`` names each
    replica's device for :meth:`info`.

    ``submit`` may be called from any thread or loop; the routing table is guarded by a
    lock held only for dictionary updates.
    """

    def __init__(self, replicas: Sequence, tokenizer, *, devices: Sequence[str], model_name: str = "default"):
        if not replicas:
            raise ValueError("a data-parallel service needs at least one replica")
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._devices = list(devices)
        self._lock = threading.Lock()
        self._routes: dict[str, RoutedLoad] = {}
        self._routed_total = [0] * len(self.replicas)
        self._draining = False

    # --- readiness and lifecycle -------------------------------------------------------

    @property
    def ready(self) -> bool:
        return all(getattr(r, "ready", True) for r in self.replicas)

    def wait_ready(self, timeout: float | int | None = None) -> bool:
        """True once every replica is built (each raises what its start-up raised); with a
        timeout, the time is shared, not given to each replica."""
        give_up = None if timeout is None else time.monotonic() + timeout
        for replica in self.replicas:
            left = None if give_up is None else max(give_up - time.monotonic(), 0.0)
            if not replica.wait_ready(left):
                return False
        return True

    async def drain(self, grace_seconds: float | int, cut_short: asyncio.Event | None = None) -> int:
        """As :meth:`AsyncEngineService.drain`, on every replica at once; returns how many
        requests were aborted in all."""
        self._draining = True
        return sum(await asyncio.gather(*(r.drain(grace_seconds, cut_short) for r in self.replicas)))

    def shutdown(self, timeout: float | int | None = 30.0) -> None:
        self._draining = True
        for replica in self.replicas:
            replica.shutdown(timeout)

    # --- the EngineService contract ----------------------------------------------------

    def queued_tokens(self) -> list[int]:
        """Per replica, the tokens its routed, unfinished requests still owe (module docstring)."""
        with self._lock:
            return self._loads_locked()[0]

    def _loads_locked(self) -> tuple[list[int], list[int]]:
        return replica_loads(self._routes.values(), len(self.replicas))

    def check_structured_outputs(self, params):
        """The constraint compiled by replica 0 (the replicas share one tokenizer, so any
        replica's engine runs it)."""
        return self.replicas[0].check_structured_outputs(params)

    def cached_prefix_tokens(self, prompt_ids, cache_salt: str | None = None) -> list[int]:
        """Per replica, the prompt tokens of ``prompt_ids`` its prefix cache holds now."""
        return [probe(prompt_ids, cache_salt) if (probe := getattr(r, "cached_prefix_tokens", None)) else 0
                for r in self.replicas]

    def submit(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Routes ``request`` to the replica with the fewest queued tokens, its cached prefix
        there not counted (the module docstring); if that one's waiting queue is full, to
        the next, and :class:`Overloaded` only when every replica refuses. Refusals for the
        request itself (:class:`InvalidRequest`) are raised at once, whichever replica
        raised them."""
        if self._draining:
            raise Unavailable("the server is shutting down and takes no new requests")
        if error := replica_errors(r.stats() for r in self.replicas):  # a replica gave up on its devices
            raise Unavailable(error)
        if not self.ready:
            raise Unavailable("the engines are still starting (compiling their executables); retry shortly")
        salt = checked_cache_salt(request.cache_salt)
        try:
            cached = self.cached_prefix_tokens(request.prompt_ids, salt)
        except (TypeError, ValueError, OverflowError):  # ids the probe cannot hash: the replica names them
            cached = [0] * len(self.replicas)
        with self._lock:
            request_id = checked_request_id(request.request_id) or new_request_id()
            if request_id in self._routes:
                raise InvalidRequest("request_id", f"{request_id!r} is already in flight; use a unique id")
            queued, live = self._loads_locked()
            routed = RoutedLoad(-1, len(request.prompt_ids), request.params.max_tokens)
            self._routes[request_id] = routed  # reserves the id while a replica validates
        request = dataclasses.replace(request, request_id=request_id)
        candidates = list(range(len(self.replicas)))
        refusal: Overloaded | None = None
        while candidates:
            index = pick_replica(queued, live, candidates, cached)
            candidates.remove(index)
            with self._lock:
                routed.replica = index  # counted at once: a burst of submits spreads
                routed.prompt_tokens = len(request.prompt_ids) - cached[index]  # the prefill owed there
            try:
                stream = self.replicas[index].submit(request)
            except Overloaded as error:
                refusal = error
                continue
            except BaseException:
                self._forget(request_id)
                raise
            with self._lock:
                self._routed_total[index] += 1
            return _RoutedStream(self, request_id, routed, stream)
        self._forget(request_id)
        raise Overloaded(f"every replica's waiting queue is full ({refusal}); retry later")

    def _account(self, routed: RoutedLoad, delta: Delta) -> None:
        with self._lock:
            routed.streamed(len(delta.token_ids), delta.finish_reason is not None)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            routed = self._routes.get(request_id)
        if routed is None or routed.replica < 0:
            return False
        return self.replicas[routed.replica].cancel(request_id)

    def stats(self) -> ServiceStats:
        """The replicas' stats summed (steps too: steps run on P devices at once); ready
        when every replica is, draining when any is; the replicas' errors, each named."""
        return self._summed([r.stats() for r in self.replicas])

    def _summed(self, each: list[ServiceStats]) -> ServiceStats:
        return summed_stats(each, draining=self._draining)

    def step_trace(self) -> list[dict]:
        """Every replica's last steps (``AsyncEngineService.step_trace``), each tagged with
        its ``replica``, in the order they ended. ``running`` and ``waiting`` are the
        replica's own."""
        steps = [{**step, "replica": index} for index, replica in enumerate(self.replicas)
                 for step in replica.step_trace()]
        return sorted(steps, key=lambda step: step["time"])

    def info(self) -> dict:
        """Replica 0's info (model, config, modes, buckets, policy, limits: the same on
        every replica), with the mesh saying ``dp``, the page pool summed, start-up
        figures summed, and ``replicas``: each one's device, queued tokens, requests
        routed to it, running, waiting, pages and steps."""
        each_stats = [r.stats() for r in self.replicas]
        each_info = [r.info() for r in self.replicas]
        with self._lock:
            (queued, live), routed = self._loads_locked(), list(self._routed_total)
        info = dict(each_info[0])
        info["model"] = self.model_name
        info["ready"] = all(s.ready for s in each_stats)
        info.pop("error", None)  # replica 0's alone; the replicas' errors, each named:
        if error := replica_errors(each_stats):
            info["error"] = error
        mesh = dict(info.get("mesh", {}))
        mesh.update(dp=len(self.replicas), devices=sum(int(i.get("mesh", {}).get("devices", 1)) for i in each_info))
        info["mesh"] = mesh
        if "page_pool" in info:
            pool = info["page_pool"]
            info["page_pool"] = {**pool, "num_pages": sum(s.engine.num_pages for s in each_stats),
                                 "free_pages": sum(s.engine.free_pages for s in each_stats),
                                 "explanation": f"summed over {len(self.replicas)} replicas, a pool each; replica 0: "
                                                f"{pool.get('explanation') or pool.get('sized_by')}"}
        if "startup" in info:
            startups = [i.get("startup", {}) for i in each_info]
            info["startup"] = {
                "executables": sum(s.get("executables", 0) for s in startups),
                "cache_hits": sum(s.get("cache_hits", 0) for s in startups),
                "compile_seconds": max(float(s.get("compile_seconds") or 0.0) for s in startups),  # concurrent
                "compile_seconds_summed": sum(float(s.get("compile_seconds_summed") or 0.0) for s in startups),
                "loaded_from_store": sum(s.get("loaded_from_store", 0) for s in startups),
                # the replicas start at once: each phase took as long as its slowest replica's
                "phase_seconds": max_by_key(s.get("phase_seconds", {}) for s in startups)}
        summed = self._summed(each_stats)
        if "prefix_cache" in info:  # each replica's own cache and grammars: the counts summed
            info["prefix_cache"] = prefix_cache_info(info["prefix_cache"].get("enabled", False), summed.engine)
            info["structured_outputs"] = structured_outputs_info(summed.engine)
        if "speculative" in info:  # replica 0's configuration (every replica's), the replicas' counts summed
            info["speculative"] = info["speculative"] | speculative_counts(summed.engine.speculative)
        info["routing"] = ("fewest queued tokens (prompt tokens not yet prefilled + max_tokens not yet streamed), "
                           "less the request's prompt tokens the replica's prefix cache holds")
        info["replicas"] = [
            {"index": i, "device": self._devices[i],
             "queued_tokens": queued[i], "live_requests": live[i],
             "routed_requests": routed[i], "running": s.engine.running, "waiting": s.engine.waiting,
             "num_pages": s.engine.num_pages, "free_pages": s.engine.free_pages, "steps": s.engine.steps,
             "ready": s.ready, "prefix_cache_hits": s.engine.prefix_cache_hits, "cached_pages": s.engine.cached_pages,
             **({"error": s.error} if s.error else {})}
            for i, s in enumerate(each_stats)]
        return info


class _RoutedStream:
    """What :meth:`DataParallelService.submit` returns: the replica's stream, passed
    through while the request's queued tokens are counted down. An object rather than an
    async generator so that ``aclose()`` forgets the route and closes the replica's
    stream even when the stream was never started (a generator's ``finally`` would not
    run then, and the route would weigh on its replica for ever)."""

    def __init__(self, service: DataParallelService, request_id: str, routed: RoutedLoad, stream):
        self._service, self._request_id, self._routed, self._stream = service, request_id, routed, stream
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        try:
            delta = await self._stream.__anext__()
        except BaseException:  # the end, a failure or a cancellation: forget it either way
            await self.aclose()
            raise
        self._service._account(self._routed, delta)
        return delta

    async def aclose(self) -> None:
        """Closed early: the replica cancels the request and frees its pages."""
        if not self._closed:
            self._closed = True
            self._service._forget(self._request_id)
            await self._stream.aclose()


class StartupSummer:
    """An :class:`EngineObserver` in front of another that sums the replicas'
    ``on_startup`` reports (executables and cache hits added, compile seconds the longest:
    the replicas compile at once) and passes every other hook through."""

    def __init__(self, observer):
        self._observer = observer
        self._lock = threading.Lock()
        self._totals = dict(compile_seconds=0.0, executables=0, cache_hits=0)

    def on_startup(self, *, compile_seconds: float, executables: int, cache_hits: int) -> None:
        with self._lock:
            totals = self._totals
            totals["compile_seconds"] = max(totals["compile_seconds"], compile_seconds)
            totals["executables"] += executables
            totals["cache_hits"] += cache_hits
            report = dict(totals)
        self._observer.on_startup(**report)  # running totals, so a gauge is never behind

    def __getattr__(self, name):
        return getattr(self._observer, name)
