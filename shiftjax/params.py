"""Canonical model parameters: the checkpoint's layout, before any parallel expansion.

Matrices are stored for ``x @ w`` (input dimension first), layers stacked on a leading
axis so that the forward pass scans over them and compile time does not grow with depth.
Hugging Face stores ``nn.Linear`` weights as ``[out, in]``; the converter transposes.
Query and key columns are in Hugging Face's rotary layout (``rotate_half``: the first
half of each head's dimensions pairs with the second half).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float

from shiftjax.config import ModelConfig
from shiftjax.pytrees import unchecked_init


@unchecked_init
@struct.dataclass
class LayerParams:
    """One decoder layer's weights, stacked over layers on axis 0."""

    attn_norm: Float[Array, "layers d_model"]
    wq: Float[Array, "layers d_model q_features"]
    wk: Float[Array, "layers d_model kv_features"]
    wv: Float[Array, "layers d_model kv_features"]
    wo: Float[Array, "layers q_features d_model"]
    mlp_norm: Float[Array, "layers d_model"]
    w_gate: Float[Array, "layers d_model d_ff"]
    w_up: Float[Array, "layers d_model d_ff"]
    w_down: Float[Array, "layers d_ff d_model"]
    bq: Float[Array, "layers q_features"] | None = None
    bk: Float[Array, "layers kv_features"] | None = None
    bv: Float[Array, "layers kv_features"] | None = None
    q_norm: Float[Array, "layers head_dim"] | None = None  # Qwen3: every q head's RMSNorm weight
    k_norm: Float[Array, "layers head_dim"] | None = None


@unchecked_init
@struct.dataclass
class Params:
    """All weights of a Llama-family decoder; ``lm_head`` is None when tied to ``embed``."""

    embed: Float[Array, "vocab d_model"]
    layers: LayerParams
    final_norm: Float[Array, "d_model"]
    lm_head: Float[Array, "d_model vocab"] | None = None


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every canonical tensor, keyed by its path (``layers.wq``, ``embed``...)."""
    d, f, n = config.hidden_size, config.intermediate_size, config.num_layers
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    shapes = {
        "embed": (config.vocab_size, d),
        "final_norm": (d,),
        "layers.attn_norm": (n, d),
        "layers.wq": (n, d, q),
        "layers.wk": (n, d, kv),
        "layers.wv": (n, d, kv),
        "layers.wo": (n, q, d),
        "layers.mlp_norm": (n, d),
        "layers.w_gate": (n, d, f),
        "layers.w_up": (n, d, f),
        "layers.w_down": (n, f, d),
    }
    if config.qkv_bias:
        shapes.update({"layers.bq": (n, q), "layers.bk": (n, kv), "layers.bv": (n, kv)})
    if config.qk_norm:
        shapes.update({"layers.q_norm": (n, config.head_dim), "layers.k_norm": (n, config.head_dim)})
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def params_from_flat(flat: dict[str, object]) -> Params:
    """Builds ``Params`` from a ``{path: array}`` dict keyed like :func:`param_shapes`."""
    layer_fields = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("layers.")}
    return Params(
        embed=flat["embed"],
        layers=LayerParams(**layer_fields),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def params_to_flat(params: Params) -> dict[str, object]:
    """The inverse of :func:`params_from_flat`; absent (None) tensors are left out."""
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    if params.lm_head is not None:
        flat["lm_head"] = params.lm_head
    for name in LayerParams.__dataclass_fields__:
        value = getattr(params.layers, name)
        if value is not None:
            flat[f"layers.{name}"] = value
    return flat


def random_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.05) -> Params:
    """Random weights of the right shapes (norm weights near 1), for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    flat = {}
    for path, shape in param_shapes(config).items():
        if path.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = scale * rng.standard_normal(shape)
        flat[path] = jnp.asarray(value, dtype=dtype)
    return params_from_flat(flat)
