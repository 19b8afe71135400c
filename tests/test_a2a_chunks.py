"""SP mode's all-to-alls cut into token chunks (``make_step(a2a_chunks=...)``): the same
cache bytes and logits as whole all-to-alls and as TP mode, and really cut."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shiftjax.batch import empty_batch
from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.model import MIN_CHUNK_TOKENS
from shiftjax.params import random_params
from shiftjax.steps import make_step, params_for
from shiftjax.weights import shard_params

CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=120, hidden_size=64, intermediate_size=100, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=16, qkv_bias=True, max_position_embeddings=2048)
PAGE_SIZE = 16


def prefill(lengths: list[int], vocab_size: int):
    """One step prefilling sequences of ``lengths`` on consecutive pages from page 1."""
    max_pages = -(-max(lengths) // PAGE_SIZE)
    batch = empty_batch(sum(lengths), len(lengths), max_pages)
    rng = np.random.default_rng(0)
    start, first_page = 0, 1
    for i, n in enumerate(lengths):
        pages = first_page + np.arange(-(-n // PAGE_SIZE))
        rows = slice(start, start + n)
        positions = np.arange(n)
        batch.token_ids[rows] = rng.integers(0, vocab_size, n)
        batch.positions[rows] = positions
        batch.slot_mapping[rows] = pages[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        batch.page_table[i, :len(pages)] = pages
        batch.seq_lens[i] = n
        batch.query_start[i + 1] = start + n
        batch.sample_index[i] = start + n - 1
        start, first_page = start + n, first_page + len(pages)
    return jax.tree.map(jnp.asarray, batch), first_page


@pytest.mark.parametrize("sp,tp,chunks", [(2, 2, 2), (4, 2, 2), (2, 1, 4)])
def test_chunked_all_to_alls_change_nothing_but_the_cut(sp, tp, chunks):
    local = chunks * MIN_CHUNK_TOKENS
    lengths = [local * sp - 300, 300]  # a sequence boundary inside a chunk
    batch, pages_used = prefill(lengths, CONFIG.vocab_size)
    mesh = make_mesh(sp, tp)
    weights = shard_params(random_params(CONFIG, seed=5), CONFIG, mesh)
    steps = {"tp": make_step(weights, "tp", attention="reference", return_logits=True),
             "sp": make_step(weights, "sp", attention="reference", return_logits=True),
             "sp_chunked": make_step(weights, "sp", attention="reference", return_logits=True, a2a_chunks=chunks)}
    results = {}
    for name, step in steps.items():
        mode = name[:2]
        caches = allocate_cache(mesh, CONFIG.num_layers, weights.layout.kv_slots, CONFIG.head_dim,
                                CacheConfig(num_pages=pages_used, page_size=PAGE_SIZE, dtype="float32"))
        lowered = step.lower(params_for(weights, mode), caches, batch).as_text()
        results[name] = (step(params_for(weights, mode), caches, batch), lowered.count("all_to_all"))
    # each layer's two all-to-alls, once per chunk (the scan body is lowered once)
    assert results["sp"][1] == 2 and results["sp_chunked"][1] == 2 * chunks
    (want, want_caches), _ = results["tp"]
    assert np.abs(np.asarray(want_caches.k)[:, :, 1:]).sum() > 0
    for name in ("sp", "sp_chunked"):
        (out, caches), _ = results[name]
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(want.logits), err_msg=name)
        for kind in ("k", "v"):
            assert np.asarray(getattr(caches, kind)).tobytes() == np.asarray(getattr(want_caches, kind)).tobytes(), \
                f"{name}: {kind} cache differs from TP mode's"


def test_short_steps_and_bad_counts():
    mesh = make_mesh(2, 1)
    weights = shard_params(random_params(CONFIG, seed=5), CONFIG, mesh)
    with pytest.raises(ValueError, match="a2a_chunks must be >= 1"):
        make_step(weights, "sp", a2a_chunks=0)
    # below MIN_CHUNK_TOKENS a device, or not divisible: whole all-to-alls
    for tokens in (2 * MIN_CHUNK_TOKENS, 2 * (2 * MIN_CHUNK_TOKENS + 1)):
        batch, pages_used = prefill([tokens], CONFIG.vocab_size)
        caches = allocate_cache(mesh, CONFIG.num_layers, weights.layout.kv_slots, CONFIG.head_dim,
                                CacheConfig(num_pages=pages_used, page_size=PAGE_SIZE, dtype="float32"))
        step = make_step(weights, "sp", attention="reference", a2a_chunks=2)
        assert step.lower(params_for(weights, "sp"), caches, batch).as_text().count("all_to_all") == 2, tokens
