"""A workload replayed through the real scheduler and shift policy in simulated time.

No model runs. Each step is scheduled by :class:`~shiftjax.serving.engine.scheduler.Scheduler`
(token budget, decodes first, chunked prefill, pages, preemption), given its bucket of the
engine's :class:`~shiftjax.serving.engine.buckets.BucketLadder` and its mode by
:class:`~shiftjax.serving.engine.policy.ShiftPolicy` by the engine's own choice
(:func:`~shiftjax.serving.engine.core.bucket_and_mode`), and then takes the seconds a
step-time model says it takes; its sampled tokens are committed to their requests at the
step's end. Arrivals join the waiting queue at their timestamps
and are seen by the next ``schedule()``, as in the engine loop. The records are timed as
the bench client times a streamed request (every sampled token is one chunk), so
:func:`~shiftjax.serving.bench.metrics.summarize` gives TTFT, TPOT, ITL and throughput by
vLLM's definitions.

Data parallelism is ``replicas`` independent schedulers, each with its own clock, and each
arrival goes to the replica :func:`~shiftjax.serving.server.data_parallel.pick_replica` picks from
its queued tokens (prompt tokens until the first output token, plus output tokens still
owed), as ``shiftjax serve --dp`` routes.

What it leaves out: host time between steps (``host_seconds_per_step`` adds a constant
in series with every step; the engine overlaps it with the step before under async
scheduling, the default, and with ``--no-async-scheduling`` only the making of a step's
deltas overlaps the next step), sampling output (tokens are 0 and ``ignore_eos`` holds), network and
detokenizing. It commits each step before it schedules the next. The engine, with async
scheduling (the default), schedules N+1 before N commits: a request that ends in step N
keeps its pages and its sequence slot until N+1, so admissions under page pressure can
come one step later than here. A
request refused with a full admission queue is a failed record, as the bench counts it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from shiftjax.serving.bench.metrics import RequestRecord, summarize
from shiftjax.serving.bench.workloads import read_trace, window_trace
from shiftjax.serving.server.data_parallel import RoutedLoad, pick_replica, replica_loads
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.core import bucket_and_mode
from shiftjax.serving.engine.policy import ShiftPolicy
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import QueueFull, Scheduler, SchedulerConfig

# (mode, padded tokens, padded seqs, [(query tokens, seq_len after the step) per real sequence]) -> seconds
StepSeconds = Callable[[str, int, int, list[tuple[int, int]]], float]


@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request: when the client wants to send it (seconds from the start) and its lengths."""

    arrival_s: float
    prompt_len: int
    output_len: int


def fixed_requests(num_requests: int, input_len: int, output_len: int) -> list[SimRequest]:
    """``num_requests`` identical requests all wanting to go at time 0 (``max_concurrency``
    then decides: 1 is the paper's one-request-at-a-time latency run)."""
    return [SimRequest(0.0, input_len, output_len) for _ in range(num_requests)]


def trace_requests(path, *, start_s: float = 0.0, duration_s: float | None = None,
                   time_scale: float = 1.0) -> list[SimRequest]:
    """A window of an Azure CSV or JSONL trace, as ``bench serve --dataset trace`` replays it."""
    window = window_trace(read_trace(path), start_s=start_s, duration_s=duration_s, time_scale=time_scale)
    return [SimRequest(r.arrival_s, r.prompt_len, r.output_len) for r in window]


@dataclasses.dataclass(frozen=True)
class StepLog:
    replica: int
    start_s: float
    seconds: float
    mode: str
    num_tokens: int  # scheduled (unpadded)
    bucket: tuple[int, int]
    num_seqs: int
    waiting: int  # queue length when it was scheduled


@dataclasses.dataclass
class SimResult:
    records: list[RequestRecord]
    steps: list[StepLog]
    duration_s: float  # first send to last completion, the bench's duration
    preemptions: int

    def summary(self, goodput_slos_ms: dict[str, float] | None = None) -> dict:
        out = summarize(self.records, self.duration_s, goodput_slos_ms)
        out["steps"] = len(self.steps)
        out["steps_by_mode"] = {m: sum(s.mode == m for s in self.steps) for m in sorted({s.mode for s in self.steps})}
        out["preemptions"] = self.preemptions
        return out


@dataclasses.dataclass
class _Replica:
    index: int
    scheduler: Scheduler
    policy: ShiftPolicy
    clock: float = 0.0


def simulate(requests: Sequence[SimRequest], *, scheduler_config: SchedulerConfig, ladder: BucketLadder,
             make_policy: Callable[[], ShiftPolicy], step_seconds: StepSeconds, replicas: int = 1,
             max_concurrency: int | None = None, host_seconds_per_step: float = 0.0) -> SimResult:
    """Replays ``requests`` (any order; sent by arrival time, at most ``max_concurrency`` in
    flight, as ``bench serve --max-concurrency`` holds them back) and returns what a bench
    client would have recorded. ``make_policy`` builds one policy per replica (the
    ``alternate`` policy keeps state)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    limit = max_concurrency or math.inf
    pool = [_Replica(r, Scheduler(scheduler_config), make_policy()) for r in range(replicas)]
    records = {i: RequestRecord(i, requests[i].prompt_len, requests[i].output_len,
                                scheduled_at=requests[i].arrival_s) for i in range(len(requests))}
    owner: dict[int, int] = {}  # id(Request) -> record index
    routes: dict[int, RoutedLoad] = {}  # record index -> what the router counts for it
    last_chunk: dict[int, float] = {}
    steps: list[StepLog] = []
    next_send = 0  # index into order
    in_flight = 0
    free_at = 0.0  # when the client last got a concurrency slot back

    def send(index: int, now: float) -> None:
        nonlocal in_flight
        spec = requests[index]
        record = records[index]
        record.sent_at = now
        replica = pool[pick_replica(*replica_loads(routes.values(), len(pool)))]
        if not replica.scheduler.has_work:
            replica.clock = max(replica.clock, now)
        try:
            request = replica.scheduler.add([1] * spec.prompt_len,
                                            SamplingParams(max_tokens=spec.output_len, ignore_eos=True))
        except QueueFull as error:  # the server answers RESOURCE_EXHAUSTED; the bench counts a failure
            record.error = str(error)
            return
        owner[id(request)] = index
        routes[index] = RoutedLoad(replica.index, spec.prompt_len, spec.output_len)
        in_flight += 1

    def send_time() -> float:
        if next_send >= len(order) or in_flight >= limit:
            return math.inf
        return max(requests[order[next_send]].arrival_s, free_at)

    while True:
        busy = [(r.clock, r.index) for r in pool if r.scheduler.has_work]
        step_at = min(busy)[0] if busy else math.inf
        arrival = send_time()
        if arrival == math.inf and step_at == math.inf:
            break
        if arrival <= step_at:  # the queue sees it before that step is scheduled
            send(order[next_send], arrival)
            next_send += 1
            continue
        replica = pool[min(busy)[1]]
        scheduler = replica.scheduler
        waiting = len(scheduler.waiting)
        scheduled = scheduler.schedule()
        if scheduled is None:  # work, but nothing fits (pages): nothing would ever free them
            raise RuntimeError(f"replica {replica.index} has requests but cannot schedule any step: "
                               "the page pool is too small for one request")
        seqs = len(scheduled.requests)
        bucket, mode = bucket_and_mode(scheduled, ladder, replica.policy)
        batch = scheduled.batch
        shape = [(int(batch.query_start[b + 1] - batch.query_start[b]), int(batch.seq_lens[b])) for b in range(seqs)]
        seconds = step_seconds(mode, bucket[0], bucket[1], shape) + host_seconds_per_step
        start = replica.clock
        replica.clock = end = start + seconds
        steps.append(StepLog(replica.index, start, seconds, mode, scheduled.num_tokens, bucket, seqs, waiting))
        sampled = [r for r, s in zip(scheduled.requests, scheduled.samples) if s]
        prompt_done = {id(r) for r in sampled if not r.output_ids}
        finished = scheduler.commit(scheduled, [0] * seqs, [0.0] * seqs, mode)
        for request in sampled:
            index = owner[id(request)]
            record = records[index]
            if id(request) in prompt_done:
                record.ttft = end - record.sent_at
            else:
                record.itl.append(end - last_chunk[index])
            last_chunk[index] = end
            record.output_tokens += 1
            routes[index].streamed(1, finished=False)
        for request in finished:
            record = records[owner[id(request)]]
            del routes[owner[id(request)]]
            record.modes = list(request.modes)  # the mode of every step it was in (Scheduler.commit)
            record.e2el = end - record.sent_at
            record.success = True
            in_flight -= 1
            free_at = max(free_at, end)
    done = [r for r in records.values() if r.success]
    lost = [r.index for r in records.values() if not r.success and not r.error]
    if lost:
        raise RuntimeError(f"requests {lost[:5]}... never finished")
    if not done:
        raise RuntimeError("no request finished (every one was refused)")
    first = min(r.sent_at for r in done)
    last = max(r.sent_at + r.e2el for r in done)
    return SimResult([records[i] for i in range(len(requests))], steps, last - first,
                     sum(r.scheduler.num_preemptions for r in pool))


def measured_run_seconds(ladder: BucketLadder, modes: Sequence[str], step_seconds: StepSeconds) -> dict:
    """What ``executables.time_executables`` would record for each bucket: the step time of an
    all-padding batch (no sequence attends to anything), keyed ``(mode, tokens, seqs)``."""
    return {(mode, t, b): step_seconds(mode, t, b, []) for mode in modes for t, b in ladder.pairs()}
