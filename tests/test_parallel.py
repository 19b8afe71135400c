"""TP mode and SP mode on every mesh of 8 virtual devices equal the single-device model."""

import numpy as np
import pytest
from stepping import run_scenario

from shiftjax.config import ModelConfig
from shiftjax.params import random_params

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2), (1, 1)]


def tiny(num_heads, num_kv_heads, *, qkv_bias=False, tie=False, ffn=96):
    return ModelConfig(
        architecture="qwen2" if qkv_bias else "llama", vocab_size=120, hidden_size=64,
        intermediate_size=ffn, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=16, qkv_bias=qkv_bias, tie_word_embeddings=tie, max_position_embeddings=64)


# Between them the configs cover, on the meshes above: H divisible by P (16 heads), H not
# divisible by P (9 heads like SmolLM2, 4 heads at P = 8), n_kv_heads < P (3 and 1 KV
# heads), n_kv_heads = 1, QKV bias, tied embeddings, and vocabulary and FFN sizes that
# need padding at P = 8 (120, 100).
CONFIGS = {
    "16_heads_8_kv": tiny(16, 8),
    "9_heads_3_kv_bias": tiny(9, 3, qkv_bias=True, ffn=100),
    "4_heads_1_kv_tied": tiny(4, 1, tie=True),
}


@pytest.fixture(scope="module")
def single_device_logits():
    cache = {}

    def get(name):
        if name not in cache:
            params = random_params(CONFIGS[name], seed=1)
            results, _ = run_scenario(params, CONFIGS[name], 1, 1, {"tp": ["tp"]})
            cache[name] = (params, results["tp"][0])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sp,tp", MESHES)
def test_modes_match_single_device(name, sp, tp, single_device_logits):
    params, expected = single_device_logits(name)
    # With sp == 1 SP mode is TP mode, so only TP mode runs there.
    runs = {"tp": ["tp"], "sp": ["sp"]} if sp > 1 else {"tp": ["tp"]}
    results, _ = run_scenario(params, CONFIGS[name], sp, tp, runs)
    for mode, (logits, _) in results.items():
        for step, (got, want) in enumerate(zip(logits, expected)):
            error = np.abs(got - want).max() / np.abs(want).max()
            assert error < 1e-5, f"{mode} mode, step {step}: relative error {error:.2e}"
