"""The engine: scheduler, caches and compiled steps.

``Engine.step()`` schedules a batch, pads it to its bucket, places it as two arrays
(``batch_upload.py``), lets the shift policy pick the mode, runs that mode's executable
with the caches donated, rebinds the caches, samples on the devices (the step packs greedy
tokens; ``samplers.py`` runs only for a batch with a row that samples or asks for
alternatives), and commits the one small result array to the requests.

With ``async_scheduling`` (the default) the host schedules and dispatches step N+1 before
it waits for step N, so the host's share of a step (scheduling, padding, placing,
launching, committing) overlaps the devices' work instead of adding to it; a step then
costs about the larger of the two (on 2x H200, Llama-3.1-8B shape, the host's launch of
the step's kernels is the larger at one sequence, and the two are close at 64;
benchmarks/x2_results.md). A request that samples in step N decodes in N+1 with a token
the host has not seen: N+1's executable takes it from N's result on the devices before
it runs the model (``token_fills.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax

from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.kernels.collectives import ALL_REDUCES, ALL_TO_ALLS, DEFAULT_CAPACITY_BYTES, setup_one_shot
from shiftjax.serving.engine import executables as exe
from shiftjax.serving.engine import page_budget as page_pool
from shiftjax.serving.engine.executable_store import ExecutableStore
from shiftjax.serving.engine.policy import ShiftPolicy
from shiftjax.serving.engine.sampler_executables import Samplers, needs_sampler
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import Request, ScheduledStep, Scheduler, SchedulerConfig
from shiftjax.serving.engine.stats import EngineSnapshot, StepCounters
from shiftjax.steps import params_for
from shiftjax.weights import ModelWeights


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 1024
    page_size: int = 16
    num_pages: int | None = None  # default: sized from device memory (page_pool.size_pool)
    kv_memory_fraction: float | None = None  # of the memory weights and temporaries leave
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    token_buckets: tuple[int, ...] | None = None  # default: BucketLadder.geometric
    seq_buckets: tuple[int, ...] | None = None
    mode: str = "auto"  # tp | sp | auto | alternate
    shift_threshold: int | None = None  # with mode auto: SP from this many tokens up
    attention: str = "auto"  # reference | pallas | auto
    # scan | unrolled | auto (unrolled on GPUs, where the scan copies every layer's weights
    # each step: 2.3x slower decode on the H200; scan elsewhere, for compile time)
    layer_loop: str = "auto"
    # cublas | triton: who runs the GEMMs on GPUs, in every step (executables.xla_compiler_options):
    # on the H200 cuBLAS compiles ~15x faster (and concurrently) and prefills 4-7% faster;
    # Triton decoded one sequence 1.07-1.09x faster (in a bucket of 1, which the default ladder lacks)
    gemm: str = "cublas"
    # auto | xla | one_shot: who sums TP mode's partials over the devices (kernels/collectives.py):
    # XLA's psum (NCCL), or on a mesh of two GPUs shiftjax's one-shot kernel, which XLA keeps
    # inside its CUDA graphs (2x H200, Llama-3.1-8B shape, served TP decode 1.03-1.11x faster,
    # the same sums bit for bit; benchmarks/x2_results.md, "A one-shot all-reduce in the
    # graph"). auto: one_shot where the mesh is two GPUs and the kernel builds, else xla.
    all_reduce: str = "auto"
    # auto | xla | one_shot: who does SP mode's two all-to-alls a layer, likewise: NCCL's, or on
    # two GPUs shiftjax's one-shot exchange (the SMs store the peer's half into it over NVLink;
    # 2x H200: 1.1-2.3x faster than NCCL's alone, served SP TPOT 1.04-1.07x, an 8B prefill step
    # 0.99-1.02x, the same bytes;
    # benchmarks/x2_results.md, "SP's exchanges by a kernel of our own").
    all_to_all: str = "auto"
    # executables compiled at once at start-up (default: executables.compile_workers)
    compile_workers: int | None = None
    cache_dtype: str | None = None  # default: the weights' dtype
    max_queue: int = 1024
    max_top_logprobs: int = 20  # alternatives a step can return per token (0: none, narrower result)
    # a directory of compiled steps (executable_store.py): a warm start skips tracing and lowering
    executable_store: str | None = None
    # dispatch step N+1 before waiting for step N (host work overlaps the devices' work)
    async_scheduling: bool = True

    def __post_init__(self):
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.attention not in ("reference", "pallas", "auto"):
            raise ValueError(f"attention must be reference, pallas or auto, got {self.attention!r}")
        if self.layer_loop not in ("scan", "unrolled", "auto"):
            raise ValueError(f"layer_loop must be scan, unrolled or auto, got {self.layer_loop!r}")
        if self.gemm not in exe.GEMM_BACKENDS:
            raise ValueError(f"gemm must be one of {', '.join(exe.GEMM_BACKENDS)}, got {self.gemm!r}")
        if self.all_reduce not in ("auto", *ALL_REDUCES):
            raise ValueError(f"all_reduce must be one of auto, {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        if self.all_to_all not in ("auto", *ALL_TO_ALLS):
            raise ValueError(f"all_to_all must be one of auto, {', '.join(ALL_TO_ALLS)}, got {self.all_to_all!r}")
        if self.compile_workers is not None and self.compile_workers < 1:
            raise ValueError(f"compile_workers must be at least 1, got {self.compile_workers}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.num_pages is not None and self.kv_memory_fraction is not None:
            raise ValueError("give num_pages or kv_memory_fraction, not both")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ValueError(f"max_top_logprobs must be in [0, 20], got {self.max_top_logprobs}")

    def pages(self) -> int:
        """``num_pages``, or the fallback where memory cannot be measured: every sequence
        slot can reach max_model_len."""
        per_seq = -(-self.max_model_len // self.page_size)
        return self.num_pages or self.max_num_seqs * per_seq + 1


# what each collective's choice is called in reports: (the kernel's work, the kernel, XLA's)
_COLLECTIVES = {"all_reduce": ("TP sums", "the one-shot all-reduce", "XLA's psum"),
                "all_to_all": ("SP exchanges", "the one-shot all-to-all", "NCCL's all-to-all")}


def _choose_collective(collective: str, asked: str, mesh, report: Callable[[str], None], phase) -> str:
    """``xla`` or ``one_shot`` for ``EngineConfig.<collective>`` (``all_reduce`` or
    ``all_to_all``) on this mesh, the one-shot kernels set up where chosen. Asked for by
    name, it must work (ValueError / RuntimeError saying why not); ``auto`` takes it on a mesh
    of two NVLink-joined GPUs of this process where it builds, reporting why where it does
    not (the results are the same bytes either way)."""
    work, kernel, fallback = _COLLECTIVES[collective]
    two_gpus = mesh.size == 2 and all(d.platform == "gpu" for d in mesh.devices.flat)
    if asked == "xla" or (asked == "auto" and not two_gpus):
        return "xla"
    if asked == "one_shot" and mesh.size != 2:
        raise ValueError(f"{collective} one_shot runs on two GPUs; this mesh has {mesh.size} devices")
    try:
        with phase(f"{collective}_setup"):
            # auto only where it was measured: GPUs joined by NVLink (a second set-up is a no-op)
            setup_one_shot(mesh.devices.flat, require_nvlink=asked == "auto")
    except Exception as error:  # noqa: BLE001 - auto: whatever stops the kernel, XLA's gives the same bytes
        if asked == "one_shot":
            raise
        report(f"{work} by {fallback}: {kernel} is unavailable ({type(error).__name__}: {error})")
        return "xla"
    report(f"{work} by {kernel} ({DEFAULT_CAPACITY_BYTES // 2**20} MiB per receive slot; larger by {fallback})")
    return "one_shot"


class StepFailed(RuntimeError):
    """A step raised; ``requests`` are the ones it had scheduled (the caller fails them)."""

    def __init__(self, requests: list[Request]):
        super().__init__(f"a step of {len(requests)} requests failed")
        self.requests = requests


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step dispatched to the devices whose result is not yet on the host."""

    scheduled: ScheduledStep
    mode: str
    bucket: tuple[int, int]
    packed: jax.Array  # on every device: the next step's token fill reads it
    host_copy: jax.Array  # one device's copy, already on its way to the host
    started: float  # time.perf_counter() when it was scheduled


@dataclasses.dataclass(frozen=True)
class PipelineTurn:
    """What one :meth:`Engine.advance` did: the steps it launched (two in a turn that found
    none in flight), the step it finished (None when that step's result failed), and the
    launches or results that failed (their requests are the caller's to fail)."""

    launched: tuple[LaunchedStep, ...]
    finished: StepReport | None
    failed: tuple[StepFailed, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one finished step did, for the service and its observer."""

    mode: str
    num_tokens: int  # scheduled tokens (before padding)
    bucket: tuple[int, int]  # (tokens, seqs) of the executable that ran
    requests: list[Request]  # the scheduled requests, in batch order
    sampled: list[bool]  # per request: did it get a token (not if it ended or was preempted first)
    finished: list[Request]
    switched: bool
    # wall time of the step, host work included: from its launch, or from the previous
    # step's end where the two overlapped, to its result on the host
    seconds: float


class Engine:
    """``report(message)``, if given, receives start-up progress lines (page pool, compiles)."""

    def __init__(self, weights: ModelWeights, config: EngineConfig, eos_token_ids=(),
                 report: Callable[[str], None] | None = None):
        report = report or (lambda message: None)
        self.weights = weights
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        model = weights.config
        if config.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings})")
        sp = weights.dims.sp
        # A fixed mode compiles only its own executables (half the start-up on a mesh);
        # auto and alternate need both.
        if sp == 1:
            self.modes = ("tp",)
        else:
            self.modes = (config.mode,) if config.mode in ("tp", "sp") else ("tp", "sp")
        if config.token_buckets is None:
            ladder = exe.BucketLadder.geometric(
                config.max_num_batched_tokens, config.max_num_seqs, multiple=sp)
            if config.seq_buckets:  # sequence buckets given alone: the geometric token buckets
                ladder = exe.BucketLadder(ladder.token_buckets, tuple(config.seq_buckets))
        else:
            ladder = exe.BucketLadder(tuple(config.token_buckets),
                                      tuple(config.seq_buckets or (config.max_num_seqs,)))
        max_pages = -(-config.max_model_len // config.page_size)
        layer_loop = config.layer_loop
        if layer_loop == "auto":
            layer_loop = "unrolled" if jax.default_backend() == "gpu" else "scan"
        dtype = config.cache_dtype or str(weights.tp.embed.dtype)
        # Seconds per start-up phase, for the log and ServerInfo: a slow start says where it went.
        self.startup_seconds: dict[str, float] = {}
        # before any step is compiled or loaded: the one-shot kernel's buffers and FFI target
        self.all_reduce = _choose_collective("all_reduce", config.all_reduce, weights.mesh, report, self._phase)
        # (no SP mode, no exchanges: nothing to set up or report)
        self.all_to_all = _choose_collective("all_to_all", config.all_to_all if "sp" in self.modes else "xla",
                                             weights.mesh, report, self._phase)
        # The steps pack greedy tokens and return logits; self.samplers samples where a row asks.
        compile_options = dict(max_pages=max_pages, attention=config.attention, layer_loop=layer_loop, gemm=config.gemm,
                               max_top_logprobs=config.max_top_logprobs, sample_in_step=False,
                               all_reduce=self.all_reduce, all_to_all=self.all_to_all)
        store = None
        if config.executable_store and jax.process_count() > 1:
            report("executable store off: a multi-process mesh would need one writer and agreed hits")
        elif config.executable_store:
            store = ExecutableStore(Path(config.executable_store))
        with self._phase("kv_cache"):  # sizing the page pool, then the cache and its fill
            self.page_pool = page_pool.size_pool(
                num_pages=config.num_pages, kv_memory_fraction=config.kv_memory_fraction,
                fallback_pages=config.pages(), mesh_devices=weights.mesh.devices,
                page_bytes=page_pool.page_bytes_per_device(model.num_layers, weights.layout.kv_slots,
                                                           config.page_size, model.head_dim, dtype,
                                                           weights.mesh.size),
                temporary_bytes=lambda: exe.temporary_bytes(
                    weights, page_pool.abstract_cache(weights.mesh, model.num_layers, weights.layout.kv_slots,
                                                      model.head_dim, config.page_size, dtype),
                    ladder, self.modes, store=store, workers=config.compile_workers, **compile_options))
            report(self.page_pool.explanation)
            num_pages = self.page_pool.num_pages
            self.scheduler = Scheduler(SchedulerConfig(
                max_num_batched_tokens=min(config.max_num_batched_tokens, ladder.token_buckets[-1]),
                max_num_seqs=min(config.max_num_seqs, ladder.max_seqs()),  # so every step fits a bucket
                max_model_len=config.max_model_len, page_size=config.page_size,
                num_pages=num_pages, max_queue=config.max_queue))
            self._cache_config = CacheConfig(num_pages=num_pages, page_size=config.page_size, dtype=dtype)
            self.caches = jax.block_until_ready(self._allocate_caches())  # the fill, not its dispatch

        def progress(done, total, elapsed):
            report(f"{done} of {total} executables ready, {elapsed:.1f} s")

        report(f"making {len(ladder.pairs()) * len(self.modes)} executables (modes {', '.join(self.modes)}; "
               f"token buckets {ladder.token_buckets}, sequence buckets {ladder.seq_buckets})")
        for seqs, tokens in ladder.padded_decode_steps():
            report(f"note: {seqs} decoding sequences run as a {tokens}-token step: a token bucket of {seqs} "
                   f"in --token-buckets would decode them faster")
        self.executables = exe.compile_all(weights, self.caches, ladder, self.modes, progress=progress,
                                           store=store, report=report, workers=config.compile_workers,
                                           **compile_options)
        self.startup_seconds["executables"] = self.executables.wall_seconds
        if self.executables.stored_keys:
            # (a stored step that fails its check is compiled again: that time is counted here)
            with self._phase("check_stored"):
                self._check_stored(ladder, store, report, compile_options)
        report(f"{len(self.executables.compiled)} executables ready in {self.executables.wall_seconds:.1f} s: "
               f"{self.executables.loaded_from_store} loaded from the executable store, "
               f"{self.executables.cache_hits} from the compilation cache")
        if config.mode == "auto" and len(self.modes) > 1 and config.shift_threshold is None:
            with self._phase("policy_timing"):
                self.caches = exe.time_executables(self.executables, weights, self.caches, max_pages,
                                                   warm=self.executables.stored_keys)
        with self._phase("samplers"):
            self.samplers = Samplers.compile(weights, ladder, config.max_top_logprobs, max_pages,
                                             store=store, report=report)
        self._no_previous = exe.empty_result(weights, ladder, config.max_top_logprobs)
        report("start-up: " + ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f} s"
                                         for phase, seconds in self.startup_seconds.items()))
        self.policy = ShiftPolicy(config.mode, self.modes, self.executables.run_seconds,
                                  threshold=config.shift_threshold)
        self._last_launched: LaunchedStep | None = None  # the source of the next step's sampled tokens
        self._in_flight: LaunchedStep | None = None  # launched by advance, not yet finished
        self._last_finished = 0.0
        self.counters = StepCounters(self.modes)

    def _check_stored(self, ladder, store, report, compile_options) -> None:
        """Runs every executable the store supplied once, on an all-padding batch (it writes
        only the scratch page). A deserialized executable can load and still fail when run
        (executable_store.py); one that fails is compiled again (and stored again), and the
        caches, which its failed donated call may have consumed, are allocated afresh."""
        failed = []
        for key in sorted(self.executables.stored_keys):
            try:
                self.caches, _ = exe.run_on_padding(self.executables, key, self.weights, self.caches,
                                                    compile_options["max_pages"])
            except Exception as error:
                report(f"stored executable {key} failed when run ({type(error).__name__}: {error}); compiling it")
                failed.append(key)
                self.caches = self._allocate_caches()
        if failed:
            again = exe.compile_all(self.weights, self.caches, ladder, self.modes, store=store, report=report,
                                    workers=self.config.compile_workers,
                                    only=failed, **compile_options)
            executables = self.executables
            executables.compiled.update(again.compiled)
            executables.compile_seconds.update(again.compile_seconds)
            executables.stored_keys = executables.stored_keys - set(failed)
            executables.cache_hits += again.cache_hits

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Times a start-up phase into ``startup_seconds[name]``."""
        started = time.perf_counter()
        yield
        self.startup_seconds[name] = time.perf_counter() - started

    def _allocate_caches(self):
        model = self.weights.config
        return allocate_cache(self.weights.mesh, model.num_layers, self.weights.layout.kv_slots,
                              model.head_dim, self._cache_config)

    @property
    def compile_seconds(self) -> float:
        """Compile (or store load) time summed over executables; the wall time of start-up
        compiling is ``executables.wall_seconds`` (lowering included)."""
        return sum(self.executables.compile_seconds.values())

    @property
    def num_pages(self) -> int:
        return self.page_pool.num_pages

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        vocab = self.weights.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return self.scheduler.add(prompt_ids, params, self.eos_token_ids)

    def step(self) -> list[Request]:
        """Runs one step; returns the requests that finished in it."""
        report = self.run_step()
        return [] if report is None else report.finished

    def run_step(self) -> StepReport | None:
        """Runs one step (None when there is nothing to run) and says what it did: one turn
        of :meth:`advance`, whose first failure it raises (:class:`StepFailed`, naming the
        requests the failed step had scheduled; the caller fails them; the requests of a
        second failure in the same turn were preempted and recompute). The next step, if
        there is work, stays in flight when it returns."""
        turn = self.advance()
        if turn is None:
            return None
        if turn.failed:
            raise turn.failed[0]
        return turn.finished

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a step is launched and not finished (between turns, one is while there is work)."""
        return self._in_flight is not None

    def advance(self) -> PipelineTurn | None:
        """One turn of the step pipeline: finishes the step in flight (launching one first
        if none is) and leaves the next one in flight, so that the caller's work on the
        finished step (its deltas) overlaps the devices' work on the next. With
        ``async_scheduling`` the next step is launched before the finished one's result is
        read (the host schedules N+1 while the devices run N); without, after it is
        committed (N+1 is scheduled knowing N's tokens). None when nothing is in flight and
        nothing can be scheduled.

        Failures are returned, not raised, so that a turn whose launch fails still reports
        the step it finished: a failed launch has put nothing in flight; a failed result
        means every step in flight is forgotten, the caches reallocated and every running
        request preempted, to recompute what it had cached. An interrupt is raised, with
        the step that was in flight kept or, while waiting for its result, forgotten the
        same way (caches kept)."""
        failed, launched = [], []
        if self._in_flight is None:
            self._in_flight = self._launch_noting(launched, failed)
            if self._in_flight is None:
                return PipelineTurn(tuple(launched), None, tuple(failed)) if failed else None
        # (an interrupt while launching the next step leaves the current one in flight)
        following = self._launch_noting(launched, failed) if self.config.async_scheduling else None
        current, self._in_flight = self._in_flight, following
        try:
            finished = self.finish_step(current)
        except StepFailed as failure:
            return PipelineTurn(tuple(launched), None, (*failed, failure))
        if not self.config.async_scheduling:
            self._in_flight = self._launch_noting(launched, failed)
        return PipelineTurn(tuple(launched), finished, tuple(failed))

    def _launch_noting(self, launched: list, failed: list) -> LaunchedStep | None:
        try:
            step = self.launch_step()
        except StepFailed as failure:
            failed.append(failure)
            return None
        if step is not None:
            launched.append(step)
        return step

    def forget_in_flight(self) -> None:
        """Drops the step in flight uncommitted (for a caller whose own bookkeeping failed):
        every running request goes back to the queue and recomputes."""
        self._start_over(new_caches=False)

    def launch_step(self) -> LaunchedStep | None:
        """The first half of a step (:meth:`advance`): schedules and dispatches it without
        waiting for the device. It may be called once more before the step is finished
        (the next step then decodes this one's samples on the device); steps are finished
        in the order they were launched."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return None
        try:
            num_tokens, num_seqs = self.executables.ladder.pick(scheduled.num_tokens, len(scheduled.requests))
            mode = self.policy.choose(num_tokens, num_seqs)
            previous, token_source = self._sampled_token_source(scheduled)
            upload = exe.place_upload(exe.pad_batch(scheduled.batch, num_tokens, num_seqs), self.weights,
                                      token_source)
            executable = self.executables.get(mode, num_tokens, num_seqs)
            out, self.caches = executable(params_for(self.weights, mode), self.caches, upload, previous)
            packed = self.samplers(out.logits, upload.sequences) if needs_sampler(scheduled.batch) else out.packed
            host_copy = exe.start_host_copy(packed)
        except BaseException as error:  # an interrupt too: nothing may stay scheduled but unlaunched
            self.scheduler.forget(scheduled)
            self._recover_caches()
            if not isinstance(error, Exception):
                raise
            raise StepFailed(scheduled.requests) from error
        self._last_launched = LaunchedStep(scheduled, mode, (num_tokens, num_seqs), packed, host_copy, start)
        return self._last_launched

    def _sampled_token_source(self, scheduled: ScheduledStep):
        """The result a step takes sampled tokens from (on the devices) and, per token, the
        row that holds it (None: the step takes none)."""
        if not scheduled.takes_sampled_tokens:
            return self._no_previous, None
        source = self._last_launched
        if source is None or source.scheduled.step_id != scheduled.source_step:
            raise RuntimeError(f"step {scheduled.step_id} takes tokens from step {scheduled.source_step}, "
                               "which is not the last one launched")
        return source.packed, scheduled.token_source

    def finish_step(self, launched: LaunchedStep) -> StepReport:
        """The second half: waits for the step's result and commits it to its requests."""
        scheduled, mode = launched.scheduled, launched.mode
        try:
            result = exe.unpack_host(exe.packed_to_host(launched.host_copy))
        except Exception as error:
            # A step that fails on the devices can leave its output caches unusable without
            # deleting them, and a step launched after it read them: start again from fresh
            # caches, every running request recomputing what it had cached.
            self._start_over(new_caches=True)
            raise StepFailed(scheduled.requests) from error
        except BaseException:  # interrupted while waiting (a notebook's Ctrl-C): recompute
            self._start_over(new_caches=False)
            raise
        switched = self.counters.count(mode, scheduled.num_tokens)
        finished = self.scheduler.commit(scheduled, result.tokens, result.logprobs, mode,
                                         result.top_ids, result.top_logprobs)
        now = time.perf_counter()
        seconds = now - max(launched.started, self._last_finished)
        self._last_finished = now
        return StepReport(mode=mode, num_tokens=scheduled.num_tokens, bucket=launched.bucket,
                          requests=scheduled.requests, sampled=scheduled.delivered, finished=finished,
                          switched=switched, seconds=seconds)

    def _start_over(self, new_caches: bool) -> None:
        """Forgets every step in flight: running requests go back to the queue (their
        commits, when they come, change nothing) and recompute what they had cached."""
        if new_caches:
            self.caches = self._allocate_caches()
        self.scheduler.preempt_all()
        self._in_flight = self._last_launched = None

    def _recover_caches(self) -> None:
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            self.caches = self._allocate_caches()
            self.scheduler.preempt_all()

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """Ends ``request`` now and frees its pages (before the next schedule)."""
        self.scheduler.abort(request, reason)

    @property
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self.scheduler.has_work

    @property
    def limits(self) -> SchedulerConfig:
        """The limits that run: ``max_num_batched_tokens`` and ``max_num_seqs`` as clamped to
        the bucket ladder, the page pool as sized (not as configured)."""
        return self.scheduler.config

    def snapshot(self) -> EngineSnapshot:
        scheduler, counters = self.scheduler, self.counters
        return EngineSnapshot(
            running=len(scheduler.running), waiting=len(scheduler.waiting), num_pages=self.num_pages - 1,
            free_pages=scheduler.allocator.num_free, preemptions=scheduler.num_preemptions,
            steps=counters.steps, switches=counters.switches, tokens=counters.tokens,
            steps_by_mode=dict(counters.steps_by_mode), tokens_by_mode=dict(counters.tokens_by_mode))

    def run_until_done(self, requests: list[Request]) -> None:
        while not all(r.finished for r in requests):
            if not self.scheduler.has_work:
                raise RuntimeError("requests are unfinished but the scheduler holds none")
            if self.run_step() is None:
                raise RuntimeError("requests are unfinished but no step can be scheduled")

