"""What ServerInfo and /v1/models report about a running engine, as plain JSON values."""

from __future__ import annotations

import collections
import dataclasses
import threading

from shiftjax.serving.engine.speculative import SpecDecodeCounters, SpeculativeConfig
from shiftjax.serving.engine.stats import EngineDescription, EngineSnapshot
from shiftjax.serving.server.protocol import ServiceStats


def service_info(engine: EngineDescription, model_name: str, stats: ServiceStats) -> dict:
    """Model, config, mesh, modes, buckets, page pool, shift policy and its timing table,
    start-up compile figures and the limits that run (``engine`` is ``stats.describe`` of
    the engine); every value JSON-serialisable."""
    limits = engine.limits
    return {
        "model": model_name,
        "ready": stats.ready,
        **({"error": stats.error} if stats.error else {}),
        "model_config": _plain(dataclasses.asdict(engine.model)),
        "mesh": {"sp": engine.sp, "tp": engine.tp, "axes": list(engine.mesh_axes), "devices": engine.devices,
                 "platform": engine.platform},
        "modes": list(engine.modes),
        "async_scheduling": engine.async_scheduling,
        "buckets": {"tokens": list(engine.token_buckets), "seqs": list(engine.seq_buckets)},
        "page_pool": {"num_pages": stats.engine.num_pages, "free_pages": stats.engine.free_pages,
                      "page_size": limits.page_size, "sized_by": engine.pool_sized_by,
                      "explanation": engine.pool_explanation},
        "policy": {"name": engine.policy, "threshold": engine.shift_threshold,
                   "timing": [{"mode": mode, "tokens": tokens, "seqs": seqs, "seconds": seconds}
                              for (mode, tokens, seqs), seconds in sorted(engine.run_seconds.items())]},
        "startup": {"executables": engine.executables, "compile_seconds": engine.compile_seconds,
                    "compile_seconds_summed": engine.compile_seconds_summed, "cache_hits": engine.cache_hits,
                    "loaded_from_store": engine.loaded_from_store, "phase_seconds": dict(engine.phase_seconds)},
        "limits": {"max_model_len": limits.max_model_len, "max_num_seqs": limits.max_num_seqs,
                   "max_num_batched_tokens": limits.max_num_batched_tokens, "max_queue": limits.max_queue,
                   "max_top_logprobs": limits.max_top_logprobs},
        "prefix_cache": prefix_cache_info(limits.enable_prefix_caching, stats.engine),
        "structured_outputs": structured_outputs_info(stats.engine),
        "speculative": speculative_info(engine.speculative, stats.engine.speculative),
        "quantization": quantization_info(engine),
    }


def quantization_info(engine: EngineDescription) -> dict:
    """What is quantized: the layer GEMM weights (``none`` or ``fp8``), the dtype of the
    rest, the KV cache's dtype, and a sentence saying it."""
    return {"weights": engine.quantization, "weights_dtype": engine.weights_dtype,
            "kv_cache_dtype": engine.kv_cache_dtype,
            "description": engine.quantization_description}


def speculative_info(config: SpeculativeConfig | None, counters: SpecDecodeCounters) -> dict:
    """Whether the engine speculates and how (every :class:`SpeculativeConfig` field, None
    when it does not), and what speculation has done (:func:`speculative_counts`)."""
    settings = (dataclasses.asdict(config) if config is not None
                else dict.fromkeys(f.name for f in dataclasses.fields(SpeculativeConfig)))
    return {"enabled": config is not None, **settings, **speculative_counts(counters)}


def speculative_counts(counters: SpecDecodeCounters) -> dict:
    """Drafts verified, their tokens, those accepted, per draft position how often it was
    accepted, the acceptance rate and mean accepted length (``SpecDecodeCounters`` says what
    each is), and the host seconds drafting took."""
    return {"acceptance_rate": counters.acceptance_rate, "mean_accepted_length": counters.mean_accepted_length,
            "num_drafts": counters.num_drafts, "num_draft_tokens": counters.num_draft_tokens,
            "num_accepted_tokens": counters.num_accepted_tokens,
            "accepted_per_position": list(counters.accepted_per_position), "draft_seconds": counters.draft_seconds}


def structured_outputs_info(stats: EngineSnapshot) -> dict:
    """The grammar library, and what structured outputs have cost: grammars compiled and
    found compiled, compile seconds, and the host time filling masks (per fill: one per
    step with a constrained row)."""
    grammar = stats.grammar
    return {"backend": "llguidance", "grammars_compiled": grammar.compiles, "grammar_cache_hits": grammar.cache_hits,
            "compile_seconds": grammar.compile_seconds, "mask_fills": grammar.mask_fills,
            "masked_rows": grammar.masked_rows, "mask_ms_per_fill": grammar.mask_ms_per_fill}


def prefix_cache_info(enabled: bool, stats: EngineSnapshot) -> dict:
    """Whether prefix caching is on, and what it has done: prompt tokens looked up
    (``queries``) and found cached (``hits``), their ratio, pages named now and evicted."""
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {"enabled": enabled, "hit_rate": hits / queries if queries else 0.0, "queries": queries, "hits": hits,
            "cached_pages": stats.cached_pages, "evicted_pages": stats.evicted_pages}


def service_stats(engine: EngineSnapshot | None, *, inbox: int, draining: bool, error: str | None) -> ServiceStats:
    """The service's stats from the engine's snapshot (None while it starts: nothing runs,
    not ready) and its own state: ``inbox`` requests submitted but not yet taken by the
    engine thread (counted as waiting), draining, the error that made it unready."""
    snapshot = engine or EngineSnapshot()
    return ServiceStats(dataclasses.replace(snapshot, waiting=snapshot.waiting + inbox),
                        ready=engine is not None and error is None, draining=draining,
                        error=None if engine is None else error)


def summed_stats(each: list[ServiceStats], *, draining: bool) -> ServiceStats:
    """Replicas' stats summed (``EngineSnapshot``'s ``+``); ready when every replica is,
    draining when any is (or ``draining``); the replicas' errors, each named."""
    return ServiceStats(sum((s.engine for s in each), EngineSnapshot()), ready=all(s.ready for s in each),
                        draining=draining or any(s.draining for s in each), error=replica_errors(each))


def replica_errors(each_stats) -> str | None:
    """Why replicas stopped being ready (``ServiceStats.error``), each named, or None."""
    return "; ".join(f"replica {i}: {s.error}" for i, s in enumerate(each_stats) if s.error) or None


def max_by_key(dicts) -> dict[str, float]:
    largest: dict[str, float] = {}
    for values in dicts:
        for key, value in values.items():
            largest[key] = max(largest.get(key, value), value)
    return largest


STEP_TRACE_STEPS = 20_000  # about a minute of steps at 3 ms each; a few MB of JSON at most


class StepTrace:
    """The last ``STEP_TRACE_STEPS`` steps, for time lines (ServerInfo's
    ``include_step_trace``): bounded, and guarded because the engine thread appends while
    a front end copies."""

    def __init__(self, size: int = STEP_TRACE_STEPS):
        self._steps: collections.deque[dict] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def append(self, step: dict) -> None:
        with self._lock:
            self._steps.append(step)

    def steps(self) -> list[dict]:
        """Oldest first."""
        with self._lock:
            return list(self._steps)


def _plain(value):
    """Tuples to lists, everything else JSON already knows."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
