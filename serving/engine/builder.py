"""Start-up: from weights and an :class:`EngineConfig` to the parts an engine runs, phase
by phase, each phase timed (a slow start says where it went):

1. the modes and the bucket ladder; the collectives chosen (the one-shot kernels set up
   before any step is compiled or loaded) and with them the :class:`StepOptions`;
2. ``kv_cache``: the page pool sized (from memory: the largest steps' temporaries are
   compiled to learn what they need), the scheduler, the cache allocated and filled;
3. ``executables``: every step loaded from the executable store or compiled;
   ``check_stored``: each stored one run once, a failing one compiled again;
4. ``policy_timing``: with ``mode="auto"`` and no threshold, every step timed for the policy;
5. ``samplers``: the samplers compiled; the runner and the policy made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax

from shiftjax.cache import CacheGeometry, pages_for
from shiftjax.kernels.collectives import DEFAULT_CAPACITY_BYTES, setup_one_shot
from shiftjax.serving.engine import compile as compiling
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.config import EngineConfig
from shiftjax.serving.engine.executable_store import ExecutableStore
from shiftjax.serving.engine.executables import Executables, run_on_padding, time_executables
from shiftjax.serving.engine.page_budget import PagePool, size_pool
from shiftjax.serving.engine.policy import ShiftPolicy
from shiftjax.serving.engine.runner import StepRunner
from shiftjax.serving.engine.sampler_executables import Samplers
from shiftjax.serving.engine.scheduler import Scheduler, SchedulerConfig
from shiftjax.step_options import StepOptions
from shiftjax.weights import ModelWeights

Report = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What start-up built, for :class:`~shiftjax.serving.engine.core.Engine`."""

    modes: tuple[str, ...]
    step_options: StepOptions
    page_pool: PagePool
    scheduler: Scheduler
    runner: StepRunner
    policy: ShiftPolicy
    startup_seconds: dict[str, float]


class _Phases:
    """Times start-up phases into ``seconds[name]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started


def engine_modes(config: EngineConfig, sp: int) -> tuple[str, ...]:
    """The modes to compile: a fixed mode only its own (half the start-up on a mesh);
    ``auto`` and ``alternate`` both; with ``sp == 1`` SP mode is TP mode."""
    if sp == 1:
        return ("tp",)
    return (config.mode,) if config.mode in ("tp", "sp") else ("tp", "sp")


def build(weights: ModelWeights, config: EngineConfig, report: Report,
          adjust_steps: Callable[[StepOptions], StepOptions] | None = None) -> EngineParts:
    """Runs the start-up phases. ``adjust_steps``: a benchmark's variant of the steps,
    given the options the config makes and returning the ones to compile."""
    model = weights.config
    if config.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model.max_position_embeddings})")
    phase, mesh = _Phases(), weights.mesh
    modes = engine_modes(config, weights.dims.sp)
    ladder = BucketLadder.for_engine(config.token_buckets, config.seq_buckets, config.max_num_batched_tokens,
                                     config.max_num_seqs, multiple=weights.dims.sp)
    geometry = CacheGeometry(model.num_layers, weights.layout.kv_slots, config.page_size, model.head_dim,
                             config.cache_dtype or str(weights.tp.embed.dtype))
    options = step_options(config, weights, modes, report, phase)
    if adjust_steps is not None:
        options = adjust_steps(options)
    store = _executable_store(config, report)
    with phase("kv_cache"):  # sizing the page pool, then the cache and its fill
        page_pool = size_pool(
            num_pages=config.num_pages, kv_memory_fraction=config.kv_memory_fraction,
            fallback_pages=config.pages(), mesh_devices=mesh.devices,
            page_bytes=geometry.page_bytes_per_device(mesh.size),
            unreachable=(geometry.triton_unreachable_pages(mesh.size)
                         if any(d.platform == "gpu" for d in mesh.devices.flat) else range(0)),
            temporary_bytes=lambda: compiling.temporary_bytes(weights, geometry.abstract(mesh), ladder, modes,
                                                              options, store=store, workers=config.compile_workers))
        report(page_pool.explanation)
        scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=min(config.max_num_batched_tokens, ladder.token_buckets[-1]),
            max_num_seqs=min(config.max_num_seqs, ladder.max_seqs()),  # so that every step fits a bucket
            max_model_len=config.max_model_len, page_size=config.page_size,
            num_pages=page_pool.num_pages, max_queue=config.max_queue,
            vocab_size=model.vocab_size, max_top_logprobs=config.max_top_logprobs,
            enable_prefix_caching=config.enable_prefix_caching), config.speculative)

        def allocate_caches():
            return geometry.allocate(mesh, page_pool.num_pages)

        caches = jax.block_until_ready(allocate_caches())  # the fill, not its dispatch
    limits = scheduler.config
    report(f"limits: {limits.max_num_batched_tokens} tokens and {limits.max_num_seqs} sequences a step, "
           f"{limits.max_model_len} tokens a sequence, {limits.num_pages - 1} pages of {limits.page_size} tokens; "
           f"prefix caching {'on' if limits.enable_prefix_caching else 'off'}")
    executables = _compile(weights, caches, ladder, modes, options, store, config, report)
    phase.seconds["executables"] = executables.wall_seconds
    if executables.stored_keys:
        # (a stored step that fails its check is compiled again: that time is counted here)
        with phase("check_stored"):
            caches = _check_stored(executables, weights, caches, allocate_caches, modes, store, config, report)
    report(f"{len(executables.compiled)} executables ready in {executables.wall_seconds:.1f} s: "
           f"{executables.loaded_from_store} loaded from the executable store, "
           f"{executables.cache_hits} from the compilation cache")
    if config.mode == "auto" and len(modes) > 1 and config.shift_threshold is None:
        with phase("policy_timing"):
            caches = time_executables(executables, weights, caches, warm=executables.stored_keys)
    with phase("samplers"):
        samplers = Samplers.compile(weights, ladder, options, store=store, report=report)
    report("start-up: " + ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s"
                                     for name, seconds in phase.seconds.items()))
    runner = StepRunner(weights, executables, samplers, caches, allocate_caches)
    policy = ShiftPolicy(config.mode, modes, executables.run_seconds, threshold=config.shift_threshold)
    return EngineParts(modes, options, page_pool, scheduler, runner, policy, phase.seconds)


def step_options(config: EngineConfig, weights: ModelWeights, modes: tuple[str, ...], report: Report,
                 phase=None) -> StepOptions:
    """The options every step of this engine is built with. The steps pack greedy tokens
    and return logits; the engine's samplers sample where a row asks. The collectives are
    chosen (and their kernels set up) here, before any step is compiled or loaded."""
    phase = phase or _Phases()
    layer_loop = config.layer_loop
    if layer_loop == "auto":
        # unrolled on GPUs, where the scan copies every layer's weights each step; scan
        # elsewhere, for compile time (model.run_layers)
        layer_loop = "unrolled" if jax.default_backend() == "gpu" else "scan"
    all_reduce = choose_collective("all_reduce", config.all_reduce, weights.mesh, report, phase)
    # (no SP mode, no exchanges: nothing to set up or report)
    all_to_all = choose_collective("all_to_all", config.all_to_all if "sp" in modes else "xla",
                                   weights.mesh, report, phase)
    return StepOptions(max_pages=pages_for(config.max_model_len, config.page_size), attention=config.attention,
                       layer_loop=layer_loop, gemm=config.gemm, max_top_logprobs=config.max_top_logprobs,
                       sample_in_step=False, all_reduce=all_reduce, all_to_all=all_to_all)


# what each collective's choice is called in reports: (the kernel's work, the kernel, XLA's)
_COLLECTIVES = {"all_reduce": ("TP sums", "the one-shot all-reduce", "XLA's psum"),
                "all_to_all": ("SP exchanges", "the one-shot all-to-all", "NCCL's all-to-all")}


def choose_collective(collective: str, asked: str, mesh, report: Report, phase) -> str:
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


def _executable_store(config: EngineConfig, report: Report) -> ExecutableStore | None:
    if config.executable_store and jax.process_count() > 1:
        report("executable store off: a multi-process mesh would need one writer and agreed hits")
        return None
    return ExecutableStore(Path(config.executable_store)) if config.executable_store else None


def _compile(weights, caches, ladder, modes, options, store, config, report) -> Executables:
    def progress(done, total, elapsed):
        report(f"{done} of {total} executables ready, {elapsed:.1f} s")

    report(f"making {len(ladder.pairs()) * len(modes)} executables (modes {', '.join(modes)}; "
           f"token buckets {ladder.token_buckets}, sequence buckets {ladder.seq_buckets})")
    for seqs, tokens in ladder.padded_decode_steps():
        report(f"note: {seqs} decoding sequences run as a {tokens}-token step: a token bucket of {seqs} "
               f"in --token-buckets would decode them faster")
    return compiling.compile_all(weights, caches, ladder, modes, options, progress=progress, store=store,
                                 report=report, workers=config.compile_workers)


def _check_stored(executables: Executables, weights, caches, allocate_caches, modes, store, config, report):
    """Runs every executable the store supplied once, on an all-padding batch (it writes
    only the scratch page). A deserialized executable can load and still fail when run
    (executable_store.py); one that fails is compiled again (and stored again), and the
    caches, which its failed donated call may have consumed, are allocated afresh."""
    failed = []
    for key in sorted(executables.stored_keys):
        try:
            caches, _ = run_on_padding(executables, key, weights, caches)
        except Exception as error:
            report(f"stored executable {key} failed when run ({type(error).__name__}: {error}); compiling it")
            failed.append(key)
            caches = allocate_caches()
    if failed:
        executables.merge(compiling.compile_all(weights, caches, executables.ladder, modes, executables.options,
                                                store=store, report=report, workers=config.compile_workers,
                                                only=failed, load_stored=False))
    return caches
