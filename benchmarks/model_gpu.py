"""The model shapes and random weights the benchmark scripts share (shift_x2.py,
decode_anatomy.py, engine_loop.py, x8_checks.py).

Until tree a752192 this was also a GPU script of its own: the layer loop's optimized HLO
(``lax.scan`` copies each layer's weights out of the stack), compile time by depth, and the
Pallas attention in the model against the reference (benchmarks/README.md, "Tried and not
kept").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shiftjax.batch import empty_batch
from shiftjax.config import ModelConfig
from shiftjax.params import param_shapes, params_from_flat

SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      max_position_embeddings=2048, tie_word_embeddings=True)
LLAMA8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192)


def device_random_params(config: ModelConfig, dtype, seed=0):
    """Random weights made on the device (a host copy of 16 GB would dominate the run)."""
    shapes = param_shapes(config)

    def make(key):
        keys = jax.random.split(key, len(shapes))
        flat = {}
        for k, (name, shape) in zip(keys, shapes.items()):
            if name.endswith("norm"):
                flat[name] = jnp.ones(shape, dtype)
            else:
                flat[name] = (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return params_from_flat(flat)

    return jax.jit(make)(jax.random.key(seed))


def decode_batch(num_seqs: int, context: int, page_size: int, max_pages: int, *, sampled: bool = False):
    """One decode token for each of ``num_seqs`` sequences of ``context`` cached tokens, each
    on its own pages (page 0 is scratch). ``sampled``: temperature 1, top-k 50, top-p 0.9
    (the sampler's sort path); else greedy, which the sampler serves without the sort."""
    batch = empty_batch(num_seqs, num_seqs, max_pages)
    pages_per_seq = context // page_size + 1
    for b in range(num_seqs):
        pages = 1 + b * pages_per_seq + np.arange(pages_per_seq)
        batch.page_table[b, :pages_per_seq] = pages
        batch.seq_lens[b] = context + 1
        batch.positions[b] = context
        batch.slot_mapping[b] = pages[context // page_size] * page_size + context % page_size
        batch.query_start[b + 1] = b + 1
        batch.sample_index[b] = b
        batch.token_ids[b] = b + 7
        if sampled:
            batch.temperature[b], batch.top_k[b], batch.top_p[b], batch.seed[b] = 1.0, 50, 0.9, b
    return batch
