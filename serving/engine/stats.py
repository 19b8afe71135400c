"""What the engine is and what it has done, as the service, metrics and ServerInfo see it:
:func:`describe` (fixed once it has started: model, mesh, buckets, page pool, start-up,
the limits that run) and ``engine.snapshot()`` (:class:`EngineSnapshot`: counters, queue
and free pages, read when asked). Nothing outside the engine reads its internals."""

from __future__ import annotations

import dataclasses

import jax

from shiftjax.config import ModelConfig
from shiftjax.quantization import describe as describe_quantization
from shiftjax.serving.engine.scheduler import SchedulerConfig
from shiftjax.serving.engine.speculative import SpecDecodeCounters, SpeculativeConfig


@dataclasses.dataclass
class StepCounters:
    """Steps, tokens and mode switches, counted as steps finish (mutated by the engine alone)."""

    modes: tuple[str, ...]
    steps: int = 0
    switches: int = 0
    tokens: int = 0
    last_mode: str | None = None
    steps_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    # structured outputs: host time filling grammar masks, the fills (one per step that
    # had a constrained row) and the rows filled
    mask_seconds: float = 0.0
    mask_fills: int = 0
    masked_rows: int = 0

    def __post_init__(self):
        self.steps_by_mode = self.steps_by_mode or dict.fromkeys(self.modes, 0)
        self.tokens_by_mode = self.tokens_by_mode or dict.fromkeys(self.modes, 0)

    def count(self, mode: str, tokens: int) -> bool:
        """Counts one finished step; whether it switched mode."""
        switched = self.last_mode not in (None, mode)
        self.switches += switched
        self.steps += 1
        self.tokens += tokens
        self.steps_by_mode[mode] += 1
        self.tokens_by_mode[mode] += tokens
        self.last_mode = mode
        return switched

    def count_masks(self, rows: int, seconds: float) -> None:
        self.mask_fills += 1
        self.masked_rows += rows
        self.mask_seconds += seconds


@dataclasses.dataclass(frozen=True)
class GrammarCounters:
    """Structured outputs so far: steps whose grammar masks were filled, the rows filled and
    the host seconds it took (``StepCounters``); grammars compiled, found compiled, and the
    seconds compiling took (``GrammarCompiler``). Passed whole to the service, which sums
    replicas' with ``+``."""

    mask_fills: int = 0
    masked_rows: int = 0
    mask_seconds: float = 0.0
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0

    def __add__(self, other: "GrammarCounters") -> "GrammarCounters":
        return GrammarCounters(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    @property
    def mask_ms_per_fill(self) -> float:
        return 1e3 * self.mask_seconds / self.mask_fills if self.mask_fills else 0.0


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state when asked (never cached), copied so that a reader on another
    thread sees numbers that belong together: the one record of these counters, which the
    service's stats carry whole (``protocol.ServiceStats``) and metrics and ServerInfo read.
    The defaults are an engine that has not started; ``+`` sums replicas' (``--dp``)."""

    running: int = 0
    waiting: int = 0
    num_pages: int = 0  # usable pages (page 0, the scratch page, excluded)
    free_pages: int = 0
    preemptions: int = 0
    steps: int = 0
    switches: int = 0
    tokens: int = 0
    steps_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    # the prefix cache: prompt tokens looked up and found (at each request's first
    # admission), pages a block hash names (shared, or free to reuse), pages evicted
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_pages: int = 0
    evicted_pages: int = 0
    grammar: GrammarCounters = GrammarCounters()
    speculative: SpecDecodeCounters = SpecDecodeCounters()

    def __add__(self, other: EngineSnapshot) -> EngineSnapshot:
        """Two engines' snapshots summed, field by field (steps too: replicas step at once)."""
        return EngineSnapshot(**{f.name: _summed(getattr(self, f.name), getattr(other, f.name))
                                 for f in dataclasses.fields(self)})


def _summed(a, b):
    """``a + b``; for counts by key (``steps_by_mode``), key by key."""
    if isinstance(a, dict):
        return {key: a.get(key, 0) + b.get(key, 0) for key in a | b}
    return a + b


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """An engine as it runs, fixed once it has started (what ServerInfo and the start-up
    report describe)."""

    model: ModelConfig
    sp: int
    tp: int
    mesh_axes: tuple[str, ...]
    devices: int
    platform: str
    modes: tuple[str, ...]
    async_scheduling: bool
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    pool_sized_by: str  # "num_pages" | "memory" | "fallback"
    pool_explanation: str
    policy: str
    shift_threshold: int | None
    # the policy's timing table: (mode, tokens, seqs) -> seconds a step of that bucket took
    run_seconds: dict[tuple[str, int, int], float]
    executables: int
    compile_seconds: float  # the wall time of start-up compiling, lowering included
    compile_seconds_summed: float  # compile (or store load) time summed over executables
    cache_hits: int  # executables from JAX's persistent compilation cache
    loaded_from_store: int  # executables from the executable store
    phase_seconds: dict[str, float]  # seconds per start-up phase, in order
    limits: SchedulerConfig  # the limits that run (engine.limits)
    speculative: SpeculativeConfig | None = None  # speculative decoding's configuration (None: off)
    quantization: str = "none"  # the layer GEMM weights': shiftjax.quantization.QUANTIZATIONS
    weights_dtype: str = ""  # the unquantized weights' (and the activations') dtype
    kv_cache_dtype: str = ""
    quantization_description: str = ""  # shiftjax.quantization.describe's sentence


def describe(engine) -> EngineDescription:
    """``engine`` (a started :class:`Engine`) as an :class:`EngineDescription`."""
    weights, executables, policy = engine.weights, engine.executables, engine.policy
    return EngineDescription(
        model=weights.config, sp=weights.dims.sp, tp=weights.dims.tp, mesh_axes=tuple(weights.mesh.axis_names),
        devices=int(weights.mesh.size), platform=jax.devices()[0].platform, modes=tuple(engine.modes),
        async_scheduling=engine.config.async_scheduling, token_buckets=tuple(executables.ladder.token_buckets),
        seq_buckets=tuple(executables.ladder.seq_buckets), pool_sized_by=engine.page_pool.sized_by,
        pool_explanation=engine.page_pool.explanation, policy=policy.policy, shift_threshold=policy.threshold, run_seconds=dict(executables.run_seconds),
        executables=len(executables.compiled), compile_seconds=executables.wall_seconds,
        compile_seconds_summed=engine.compile_seconds, cache_hits=executables.cache_hits,
        loaded_from_store=executables.loaded_from_store, phase_seconds=dict(engine.startup_seconds),
        limits=engine.limits, speculative=engine.config.speculative, quantization=weights.quantization,
        weights_dtype=str(weights.tp.embed.dtype), kv_cache_dtype=engine.config.cache_dtype or str(weights.tp.embed.dtype),
        quantization_description=describe_quantization(weights.quantization, weights.tp.embed.dtype))
