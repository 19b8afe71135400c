"""The two step functions: TP mode (``psum``) and Ulysses SP mode (``all_to_all``).

Both have the contract ``out, caches = step(params, caches, batch)`` with the caches
donated, both write the same cache arrays with the same PartitionSpec, and both sample
on the device so that one small ``[seqs, 2 + 2 * max_top_logprobs]`` int32 array (token,
float32 log-prob bits, then the alternatives' ids and log-prob bits) is all that goes to
the host. A step made with ``sample_in_step=False`` packs the greedy tokens only and
returns the logits, for the engine's separate sampler (``serving/engine/sampler_executables.py``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from shiftjax.batch import StepBatch
from shiftjax.cache import KVCache
from shiftjax.config import rope_inverse_frequencies
from shiftjax.kernels.collectives import check_one_shot_ready, first_ordinal_of
from shiftjax.kernels.fp8_gemm import gpu_supports_fp8
from shiftjax.layouts.mesh import SP
from shiftjax.layouts.specs import CACHE_SPEC, REPLICATED
from shiftjax.model import (
    Context,
    embed_tokens,
    lm_logits,
    rms_norm,
    run_layers,
    sp_layer,
    tp_layer,
)
from shiftjax.pytrees import unchecked_init
from shiftjax.sampling import pack_greedy, pack_samples
from shiftjax.step_options import StepOptions
from shiftjax.weights import ModelWeights, ShardedParams

Mode = Literal["tp", "sp"]
MODES = ("tp", "sp")


@unchecked_init
@struct.dataclass
class StepOutput:
    # [seqs, 2 + 2 * K] int32: sampled token, bit pattern of its float32 log-prob, then the
    # K most likely tokens' ids and their log-prob bits (K = max_top_logprobs, maybe 0)
    packed: jax.Array
    logits: jax.Array | None = None  # [seqs, vocab] float32: with return_logits or sample_in_step=False


def make_step(weights: ModelWeights, mode: Mode, options: StepOptions = StepOptions(), *,
              return_logits: bool = False):
    """The jitted step of ``mode`` for these weights, built as ``options`` say
    (:class:`~shiftjax.step_options.StepOptions`); caches (argument 1) are donated. A
    step where no row asks for alternatives skips the top-k.

    ``options.sample_in_step=False``: every row gets its most likely token (the
    alternatives' columns zero) and the logits are returned, so that the engine samples
    separately, and only in steps where a row asks for it. The in-step sampler skips its sort for
    all-greedy batches with a ``lax.cond``, and XLA's GPU conditional copies its predicate
    to the host and blocks the host until the device gets there: the host could not
    dispatch a step while the one before it runs (2x H200, one sequence, in one run: 10.30
    ms a decode step with it, 6.55 ms without; benchmarks/README.md, "Sampling outside the step").
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    attention, layer_loop, all_reduce, all_to_all = (options.attention, options.layer_loop, options.all_reduce,
                                                     options.all_to_all)
    max_top_logprobs, sample_in_step = options.max_top_logprobs, options.sample_in_step
    if max_top_logprobs > weights.config.vocab_size:
        raise ValueError(f"max_top_logprobs must be in [0, vocab_size], got {max_top_logprobs}")
    if "one_shot" in (all_reduce, all_to_all) and weights.mesh.size == 2:
        check_one_shot_ready(weights.mesh.devices.flat)
    config, dims, mesh = weights.config, weights.dims, weights.mesh
    inv_freq = tuple(rope_inverse_frequencies(config))
    layer_fn = tp_layer if mode == "tp" else sp_layer
    quantized_gemm = quantized_gemm_for(options.quantized_gemm, mesh)

    with_logits = return_logits or not sample_in_step
    view = params_for(weights, mode)
    param_leaves, param_tree = jax.tree.flatten(view)

    def local_step(param_leaves, k_cache, v_cache, batch: StepBatch):
        params: ShardedParams = param_tree.unflatten(param_leaves)
        ctx = Context(dims, config.rms_norm_eps, jnp.asarray(inv_freq, jnp.float32), batch, attention, all_reduce,
                      all_to_all, first_ordinal_of(mesh), quantized_gemm, options.fp8_gemm)
        x = embed_tokens(batch.token_ids, params.embed, dims)
        if mode == "sp":
            local_tokens = x.shape[0] // dims.sp
            first = lax.axis_index(SP) * local_tokens
            x = lax.dynamic_slice_in_dim(x, first, local_tokens)
        x, k_cache, v_cache = run_layers(layer_fn, x, params.layers, k_cache, v_cache, ctx,
                                         unrolled=layer_loop == "unrolled")
        if mode == "tp":
            rows = jnp.take(x, jnp.maximum(batch.sample_index, 0), axis=0)
        else:  # each sampled row lives on one sp rank; the psum adds zeros elsewhere
            local = batch.sample_index - first
            mine = (local >= 0) & (local < local_tokens)
            rows = jnp.take(x, jnp.clip(local, 0, local_tokens - 1), axis=0)
            rows = lax.psum(jnp.where(mine[:, None], rows, jnp.zeros((), x.dtype)), SP)
        rows = rms_norm(rows, params.final_norm, config.rms_norm_eps)
        logits = lm_logits(rows, params.embed, params.lm_head, dims)
        if sample_in_step:
            packed = pack_samples(logits, batch, max_top_logprobs)
        else:
            packed = pack_greedy(logits, max_top_logprobs)
        outputs = (packed, logits) if with_logits else (packed,)
        return outputs, k_cache, v_cache

    # Specs are read off the placed arrays, so they cannot disagree with the data.
    param_specs = [leaf.sharding.spec for leaf in param_leaves]
    cache = CACHE_SPEC
    sharded = jax.shard_map(
        local_step, mesh=mesh,
        in_specs=(param_specs, cache, cache, REPLICATED),
        out_specs=((REPLICATED,) * (2 if with_logits else 1), cache, cache),
        # The outputs are replicated by construction (logits all-gathered over every axis,
        # the sampler reading only replicated inputs); JAX 0.10.2's static check did not
        # infer it. tests/test_parallel.py checks the outputs on every mesh instead.
        check_vma=False,
    )

    def step(params: ShardedParams, caches: KVCache, batch: StepBatch):
        if mode == "sp" and batch.num_tokens % dims.sp:
            raise ValueError(f"SP mode needs a token count divisible by sp={dims.sp}, got {batch.num_tokens}")
        outputs, k, v = sharded(jax.tree.leaves(params), caches.k, caches.v, batch)
        return StepOutput(*outputs), KVCache(k=k, v=v)

    return jax.jit(step, donate_argnums=(1,))


def quantized_gemm_for(asked: str, mesh) -> str:
    """``StepOptions.quantized_gemm`` resolved: ``auto`` is the Mosaic GPU kernels where
    every device has FP8 tensor cores, else the reference (which runs anywhere, slower)."""
    if asked != "auto":
        return asked
    return "pallas" if all(gpu_supports_fp8(device) for device in mesh.devices.flat) else "reference"


def params_for(weights: ModelWeights, mode: Mode) -> ShardedParams:
    return weights.tp if mode == "tp" else weights.sp
