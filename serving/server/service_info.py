"""What ServerInfo and /v1/models report about a running engine, as plain JSON values."""

from __future__ import annotations

import dataclasses

import jax

from shiftjax.serving.engine.core import Engine
from shiftjax.serving.server.protocol import ServiceStats


def service_info(engine: Engine, model_name: str, stats: ServiceStats) -> dict:
    """Model, config, mesh, modes, buckets, page pool, shift policy and its timing table,
    start-up compile figures and limits; every value JSON-serialisable."""
    model = engine.weights.config
    mesh = engine.weights.mesh
    config = engine.config
    executables = engine.executables
    policy = engine.policy
    return {
        "model": model_name,
        "ready": stats.ready,
        **({"error": stats.error} if stats.error else {}),
        "model_config": _plain(dataclasses.asdict(model)),
        "mesh": {"sp": engine.weights.dims.sp, "tp": engine.weights.dims.tp,
                 "axes": list(mesh.axis_names), "devices": int(mesh.size),
                 "platform": jax.devices()[0].platform},
        "modes": list(engine.modes),
        "async_scheduling": config.async_scheduling,
        "buckets": {"tokens": list(executables.ladder.token_buckets),
                    "seqs": list(executables.ladder.seq_buckets)},
        "page_pool": {"num_pages": stats.num_pages, "free_pages": stats.free_pages,
                      "page_size": config.page_size, "sized_by": engine.page_pool.sized_by,
                      "explanation": engine.page_pool.explanation},
        "policy": {"name": policy.policy, "threshold": policy.threshold,
                   "timing": [{"mode": mode, "tokens": tokens, "seqs": seqs, "seconds": seconds}
                              for (mode, tokens, seqs), seconds in sorted(executables.run_seconds.items())]},
        "startup": {"executables": len(executables.compiled), "compile_seconds": executables.wall_seconds,
                    "compile_seconds_summed": engine.compile_seconds, "cache_hits": executables.cache_hits,
                    "loaded_from_store": executables.loaded_from_store,
                    "phase_seconds": dict(engine.startup_seconds)},
        "limits": {"max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens, "max_queue": config.max_queue,
                   "max_top_logprobs": config.max_top_logprobs},
    }


def _plain(value):
    """Tuples to lists, everything else JSON already knows."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
