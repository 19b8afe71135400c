"""The JAX model equals Hugging Face transformers on the same weights (float32).

Tiny random Llama (llama3 RoPE scaling, untied head), Qwen2 (QKV bias), Qwen3 (q/k norms,
tied) and tied-embedding checkpoints are saved as real safetensors, converted to Orbax, restored, and run through
the step function over the paged cache: a prefill in two chunks (the second attends to
the first through the cache), a second sequence alongside, and decode steps.
"""

import numpy as np
import pytest
import stepping
import torch
from hf_tiny import make_tiny_hf_checkpoint

from shiftjax.checkpoints import convert_hf_checkpoint, load_checkpoint


def hf_logits_at(model, tokens: list[int], positions: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    return logits[positions]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "tied"])
def test_logits_match_transformers(tmp_path, kind):
    hf_dir, model = make_tiny_hf_checkpoint(tmp_path / "hf", kind, num_heads=4, num_kv_heads=2,
                                            vocab_size=128, seed=7)
    convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    config, params = load_checkpoint(tmp_path / "ckpt")
    assert config.tie_word_embeddings == (kind in ("tied", "qwen3"))
    assert config.qkv_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    results, _ = stepping.run_scenario(params, config, 1, 1, {"tp": ["tp"]})
    logits = results["tp"][0]

    # Each sequence's whole token list, and which of our (step, row) logits sit where.
    tokens = {0: [], 1: []}
    wanted = {0: [], 1: []}
    for step, chunks in enumerate(stepping.scenario(config.vocab_size)):
        for row, (seq, chunk) in enumerate(chunks):
            tokens[seq] += chunk
            wanted[seq].append((len(tokens[seq]) - 1, logits[step][row]))
    for seq in (0, 1):
        positions = [p for p, _ in wanted[seq]]
        expected = hf_logits_at(model, tokens[seq], positions)
        got = np.stack([l for _, l in wanted[seq]])
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error < 1e-4, f"sequence {seq}: relative error {error:.2e}"
