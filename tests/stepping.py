"""A small driver that runs the step functions directly on hand-built batches (no tests here).

The scenario is fixed and exercises what the engine does: two sequences prefilled in
chunks (the second chunk of sequence 0 attends to its first chunk in the cache), then
decode steps of both, with shuffled pages and padding tokens and sequences.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from shiftjax.batch import empty_batch
from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.layouts.mesh import make_mesh
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step, params_for
from shiftjax.weights import shard_params

PAGE_SIZE = 4
MAX_PAGES = 6
NUM_PAGES = 16
# Shuffled pages per sequence (page 0 is scratch).
PAGES = ([7, 3, 11, 5], [2, 9, 14, 6])


def scenario(vocab_size: int, seed: int = 0):
    """Steps as lists of (seq, token ids): prefill chunks, then three decode steps."""
    rng = np.random.default_rng(seed)
    prompt0 = rng.integers(0, vocab_size, 9).tolist()
    prompt1 = rng.integers(0, vocab_size, 5).tolist()
    steps = [
        [(0, prompt0[:6]), (1, prompt1)],
        [(0, prompt0[6:])],
    ]
    for _ in range(3):
        steps.append([(0, [int(rng.integers(vocab_size))]), (1, [int(rng.integers(vocab_size))])])
    return steps


def build_batch(step, seq_lens_before, num_tokens: int = 16, num_seqs: int = 4):
    """A padded host batch for one step of the scenario; samples the last token of each."""
    batch = empty_batch(num_tokens, num_seqs, MAX_PAGES)
    start = 0
    for b, (seq, tokens) in enumerate(step):
        first = seq_lens_before[seq]
        positions = np.arange(first, first + len(tokens))
        pages = np.asarray(PAGES[seq])
        batch.token_ids[start:start + len(tokens)] = tokens
        batch.positions[start:start + len(tokens)] = positions
        batch.slot_mapping[start:start + len(tokens)] = (
            pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE)
        start += len(tokens)
        batch.query_start[b + 1] = start
        batch.seq_lens[b] = first + len(tokens)
        batch.page_table[b, :len(pages)] = pages
        batch.sample_index[b] = start - 1
    batch.query_start[len(step) + 1:] = start
    return batch


def run_scenario(params, config, sp: int, tp: int, runs: dict[str, list[str]], *,
                 storage="aliased", cache_dtype="float32", layer_loop="scan", quantization="none",
                 fp8_gemm=None):
    """Runs the scenario once per entry of ``runs`` (name -> modes, cycled step by step),
    each with fresh caches, all on one expansion of the weights.

    Returns ``{name: (per-step logits of the sampled rows as numpy, final caches)}`` and
    the weights.
    """
    mesh = make_mesh(sp, tp)
    weights = shard_params(params, config, mesh, storage, quantization)
    modes_used = {mode for modes in runs.values() for mode in modes}
    options = StepOptions(attention="reference", layer_loop=layer_loop)
    if fp8_gemm is not None:
        options = dataclasses.replace(options, fp8_gemm=fp8_gemm)
    steps = {mode: make_step(weights, mode, options, return_logits=True)
             for mode in modes_used}
    results = {}
    for name, modes in runs.items():
        caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                                CacheConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE, dtype=cache_dtype))
        seq_lens = [0, 0]
        logits = []
        for i, step_tokens in enumerate(scenario(config.vocab_size)):
            mode = modes[i % len(modes)]
            batch = jax.tree.map(jnp.asarray, build_batch(step_tokens, seq_lens))
            out, caches = steps[mode](params_for(weights, mode), caches, batch)
            logits.append(np.asarray(out.logits)[:len(step_tokens)])
            for seq, tokens in step_tokens:
                seq_lens[seq] += len(tokens)
        results[name] = (logits, caches)
    return results, weights
