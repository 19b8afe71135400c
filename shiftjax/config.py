"""Model configuration read from a Hugging Face ``config.json``.

One frozen dataclass covers the Llama family that shiftjax serves: Llama 2, Llama 3/3.x
(with ``llama3`` RoPE scaling), Mistral without sliding window, Qwen2/2.5 (QKV bias),
Qwen3 (per-head RMSNorm of q and k before RoPE) and SmolLM2. Anything else fails at
construction with a sentence naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# transformers' default head_dim where config.json has none (else hidden_size / heads)
DEFAULT_HEAD_DIM = {"qwen3": 128}


class ConfigError(ValueError):
    """A model configuration that shiftjax cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The ``rope_scaling`` block of Llama 3.1+ (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor < 1.0:
            raise ConfigError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be positive")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a Llama-family decoder."""

    architecture: str  # "llama", "mistral", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; expected one of "
                f"{sorted(SUPPORTED_ARCHITECTURES.values())}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Reads a Hugging Face ``config.json`` dictionary; errors name the field."""
        architectures = hf.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures={architectures!r} is not supported; shiftjax serves "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = SUPPORTED_ARCHITECTURES[architectures[0]]

        def need(key: str):
            if key not in hf:
                raise ConfigError(f"config.json lacks the field {key!r}")
            return hf[key]

        if architecture in ("mistral", "qwen2", "qwen3"):
            window = hf.get("sliding_window")
            uses_window = hf.get("use_sliding_window", architecture == "mistral")
            max_len = hf.get("max_position_embeddings", 4096)
            if uses_window and window is not None and window < max_len:
                raise ConfigError(
                    f"sliding_window={window} is smaller than max_position_embeddings="
                    f"{max_len}; sliding-window attention is not supported"
                )
        layer_types = hf.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            kinds = sorted(set(layer_types) - {"full_attention"})
            raise ConfigError(f"layer_types={kinds!r}: only full_attention layers are supported")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; expected 'silu'")
        if architecture in ("llama", "mistral", "qwen3") and hf.get("attention_bias"):
            # Their attention_bias also biases o_proj, which the layout does not carry.
            raise ConfigError(f"attention_bias=true (biased o_proj) is not supported for {architecture}")

        num_heads = need("num_attention_heads")
        hidden_size = need("hidden_size")
        head_dim = hf.get("head_dim") or DEFAULT_HEAD_DIM.get(architecture) or hidden_size // num_heads
        rope_scaling = _read_rope_scaling(hf.get("rope_scaling"), hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from None
        return cls.from_hf_dict(hf)


def _read_rope_scaling(block: dict | None, hf: dict) -> Llama3RopeScaling | None:
    if block is None:
        block = hf.get("rope_parameters")
        if block is None or block.get("rope_type", "default") == "default":
            return None
    kind = block.get("rope_type") or block.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type={kind!r} is not supported; expected 'llama3'")
    try:
        return Llama3RopeScaling(
            factor=float(block["factor"]),
            low_freq_factor=float(block["low_freq_factor"]),
            high_freq_factor=float(block["high_freq_factor"]),
            original_max_position_embeddings=int(block["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ConfigError(f"rope_scaling lacks the field {missing.args[0]!r}") from None


def rope_inverse_frequencies(config: ModelConfig) -> list[float]:
    """Per-pair inverse frequencies, with Llama 3's piecewise rescaling when configured."""
    dim = config.head_dim
    inv = [1.0 / (config.rope_theta ** (2 * i / dim)) for i in range(dim // 2)]
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return out
