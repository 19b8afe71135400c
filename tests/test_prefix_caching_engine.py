"""Prefix caching end to end on the CPU mesh: a crowded workload with heavy prefix sharing,
chunked prefill and preemption generates, with the cache on, exactly the greedy tokens of
the cache off and of transformers, in every mode, on the 2x2 and 2x4 meshes; the cache was
hit, pages were preempted, and every page comes back."""

import jax
import numpy as np
import pytest
import torch
from test_parallel import transformers_model

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# 4-token pages, 16 tokens a step (long prompts are chunked), 13 usable pages for up to four
# sequences of up to 33 tokens (9 pages) each: page pressure preempts, shared pages or not
OPTIONS = dict(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(4, 16),
               seq_buckets=(4,), attention="reference", num_pages=14)


def workload(seed: int = 3) -> list[list[int]]:
    """Two waves of prompts: two shared prefixes (of 12 and 21 tokens), cut at various
    lengths, each with a suffix of its own, and a repeat of the first prompt."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 96, 12).tolist(), rng.integers(3, 96, 21).tolist()]
    prompts = []
    for i in range(9):
        prefix = prefixes[i % 2]
        prompts.append(prefix[:len(prefix) - i // 2] + rng.integers(3, 96, 1 + i % 4).tolist())
    return prompts + [list(prompts[0])]


def run(engine: Engine, prompts) -> list[list[int]]:
    """Two waves (the second finds the first's pages committed), crowded within each."""
    outputs = []
    for wave in (prompts[:6], prompts[6:]):
        requests = [engine.add_request(p, GREEDY) for p in wave]
        engine.run_until_done(requests)
        outputs += [r.output_ids for r in requests]
    assert not engine.has_work
    engine.scheduler.allocator.check()
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1
    return outputs


def oracle(params, prompts) -> list[list[int]]:
    model = transformers_model(params, CONFIG)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(GREEDY.max_tokens):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            outputs.append(tokens[len(prompt):])
    return outputs


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=7, scale=0.3)


@pytest.fixture(scope="module")
def expected(params):
    return oracle(params, workload())


@pytest.mark.slow
@pytest.mark.parametrize("sp, tp", [(2, 2), (2, 4)])
def test_cached_prefixes_change_no_token_in_any_mode(params, expected, sp, tp):
    weights = shard_params(params, CONFIG, make_mesh(sp, tp, jax.devices()[:sp * tp]))
    prompts = workload()
    off = Engine(weights, EngineConfig(mode="tp", enable_prefix_caching=False, **OPTIONS))
    assert run(off, prompts) == expected
    for mode in ("tp", "sp", "alternate", "auto"):
        engine = Engine(weights, EngineConfig(mode=mode, **OPTIONS))
        assert run(engine, prompts) == expected, mode
        cache = engine.scheduler.prefix_cache
        assert cache.hits > 0.3 * cache.queries, (mode, cache.hits, cache.queries)
        assert engine.scheduler.num_preemptions > 0, mode
