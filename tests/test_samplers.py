"""The engine's split sampling: a step made with ``sample_in_step=False`` packs greedy
tokens, returns its logits and holds no conditional (on a GPU one blocks the host); the
separate sampler gives, from those logits, exactly what the in-step sampler gives."""

import functools

import jax
import numpy as np
import pytest

from shiftjax.batch import empty_batch
from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.sampling import pack_samples
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.sampler_executables import Samplers, needs_sampler
from shiftjax.serving.engine.transfers import place_upload, to_device
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step, params_for
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
PAGE, MAX_PAGES, TOP = 4, 4, 3


@pytest.fixture(scope="module")
def weights():
    return shard_params(random_params(CONFIG, seed=3, scale=0.5), CONFIG, make_mesh(2, 2))


def mixed_batch():
    """Four prompts of 3 tokens: greedy; sampled with filters; greedy with alternatives;
    sampled with alternatives."""
    batch = empty_batch(16, 4, MAX_PAGES)
    for b in range(4):
        lo = 3 * b
        batch.token_ids[lo:lo + 3] = [5 + b, 17, 33 - b]
        batch.positions[lo:lo + 3] = [0, 1, 2]
        batch.slot_mapping[lo:lo + 3] = (b + 1) * PAGE + np.arange(3)
        batch.query_start[b + 1] = lo + 3
        batch.seq_lens[b] = 3
        batch.page_table[b, 0] = b + 1
        batch.sample_index[b] = lo + 2
        batch.seed[b] = 7 + b
    batch.query_start[5:] = 12
    batch.temperature[[1, 3]] = [0.8, 1.3]
    batch.top_k[1], batch.top_p[1], batch.min_p[3] = 20, 0.9, 0.05
    batch.top_logprobs[[2, 3]] = [2, 3]
    return batch


def run(weights, batch, **options):
    step = make_step(weights, "tp", StepOptions(attention="reference", max_top_logprobs=TOP, **options))
    caches = allocate_cache(weights.mesh, CONFIG.num_layers, weights.layout.kv_slots, CONFIG.head_dim,
                            CacheConfig(num_pages=8, page_size=PAGE, dtype="float32"))
    placed = to_device(batch, weights)
    out, _ = step(params_for(weights, "tp"), caches, placed)
    return out, placed, step


def test_the_sampler_gives_what_the_step_gives(weights):
    batch = mixed_batch()
    assert needs_sampler(batch)
    in_step, _, _ = run(weights, batch)
    split, _, _ = run(weights, batch, sample_in_step=False)
    # result rows 8: the sampler reads the step's upload and pads as the steps do
    samplers = Samplers.compile(weights, BucketLadder((16,), (1, 4, 8)), StepOptions(max_pages=MAX_PAGES, max_top_logprobs=TOP))
    padded = np.asarray(samplers(split.logits, place_upload(batch, weights).sequences))
    assert padded.shape == (8, 2 + 2 * TOP) and not padded[4:].any()
    sampled = padded[:4]
    np.testing.assert_array_equal(sampled, np.asarray(in_step.packed))
    greedy = np.asarray(split.packed)  # the step's own packing: greedy rows right, no alternatives
    np.testing.assert_array_equal(greedy[[0, 2], :2], sampled[[0, 2], :2])
    assert not greedy[:, 2:].any()
    assert sampled[[2, 3], 2:].any()


def test_a_step_without_sampling_has_no_conditional(weights):
    batch = mixed_batch()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    texts = {}
    for in_step in (True, False):
        _, _, step = run(weights, batch, sample_in_step=in_step)
        caches = allocate_cache(weights.mesh, CONFIG.num_layers, weights.layout.kv_slots, CONFIG.head_dim,
                                CacheConfig(num_pages=8, page_size=PAGE, dtype="float32"))
        texts[in_step] = step.lower(params_for(weights, "tp"), caches, abstract).as_text()
    assert "stablehlo.case" in texts[True]  # the in-step sampler's skips
    assert "stablehlo.case" not in texts[False] and "stablehlo.if" not in texts[False]


def test_an_all_greedy_batch_needs_no_sampler():
    batch = mixed_batch()
    batch.temperature[:] = 0
    batch.top_logprobs[:] = 0
    assert not needs_sampler(batch)


def test_the_sampler_has_no_conditional(weights):
    samplers = Samplers.compile(weights, BucketLadder((16,), (4,)), StepOptions(max_pages=MAX_PAGES, max_top_logprobs=TOP))
    assert all("conditional(" not in samplers.compiled[kind, 4].as_text() for kind in ("sample", "greedy"))
    # the check can fail: the same sampler with its skips compiles to conditionals
    skipping = jax.jit(functools.partial(pack_samples, max_top_logprobs=TOP, skip_unneeded=True))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), empty_batch(1, 4, 1))
    logits = jax.ShapeDtypeStruct((4, CONFIG.vocab_size), np.float32)
    assert "conditional(" in skipping.lower(logits, abstract).compile().as_text()
