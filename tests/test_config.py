"""ModelConfig from Hugging Face config.json: supported families read right, the rest refused by field."""

import pytest

from shiftjax.config import ConfigError, ModelConfig

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def test_llama31_is_read():
    config = ModelConfig.from_hf_dict(LLAMA)
    assert (config.architecture, config.head_dim, config.q_per_kv) == ("llama", 128, 4)
    assert config.rope_scaling.factor == 8.0 and config.eos_token_ids == (128001, 128008, 128009)
    assert not config.qkv_bias and not config.tie_word_embeddings


def test_qwen2_has_qkv_bias_and_mistral_without_window_is_accepted():
    qwen = LLAMA | {"architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
                    "use_sliding_window": False, "sliding_window": 4096, "tie_word_embeddings": True}
    config = ModelConfig.from_hf_dict(qwen)
    assert config.qkv_bias and config.tie_word_embeddings
    mistral = LLAMA | {"architectures": ["MistralForCausalLM"], "rope_scaling": None, "sliding_window": None}
    assert ModelConfig.from_hf_dict(mistral).architecture == "mistral"


def test_qwen3_has_qk_norms_and_its_default_head_dim():
    qwen3 = LLAMA | {"architectures": ["Qwen3ForCausalLM"], "rope_scaling": None, "head_dim": 128,
                     "hidden_size": 2048, "num_attention_heads": 32, "use_sliding_window": False,
                     "sliding_window": None, "layer_types": ["full_attention"] * 32}
    config = ModelConfig.from_hf_dict(qwen3)
    assert (config.architecture, config.qk_norm, config.qkv_bias, config.head_dim) == ("qwen3", True, False, 128)
    # transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads (64 here)
    assert ModelConfig.from_hf_dict({k: v for k, v in qwen3.items() if k != "head_dim"}).head_dim == 128
    assert not ModelConfig.from_hf_dict(LLAMA).qk_norm


@pytest.mark.parametrize("change,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_type"),
])
def test_qwen3_fields_it_cannot_serve_are_refused_by_name(change, field):
    qwen3 = LLAMA | {"architectures": ["Qwen3ForCausalLM"], "rope_scaling": None} | change
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(qwen3)


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_hidden_layers": 0}, "num_layers"),
    ({"attention_bias": True}, "attention_bias"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_or_inconsistent_configs_name_the_field(change, field):
    hf = LLAMA | change
    if change.get("vocab_size", 1) is None:
        del hf["vocab_size"]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(hf)


def test_mistral_sliding_window_is_refused():
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.from_hf_dict(LLAMA | {"architectures": ["MistralForCausalLM"], "rope_scaling": None,
                                          "sliding_window": 4096})


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "config.json")
