"""TP mode and SP mode on every mesh of 8 virtual devices equal the single-device model,
the single-device model equals transformers, and every device holds the same replicated
outputs.

The step's ``shard_map`` runs with ``check_vma=False`` (shiftjax/steps.py), so nothing in
JAX checks that its "replicated" outputs (the sampled tokens, the logits) really agree
across devices; reading one shard would not notice. Every step of every mesh here is
checked on all addressable shards; ``test_the_shard_check_rejects_a_differing_shard``
keeps the proof that the check fails when one device disagrees.
"""

import jax
import numpy as np
import pytest
import stepping
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from stepping import run_scenario

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2)]


def tiny(num_heads, num_kv_heads, *, qkv_bias=False, qk_norm=False, tie=False, ffn=96):
    architecture = "qwen2" if qkv_bias else "qwen3" if qk_norm else "llama"
    return ModelConfig(
        architecture=architecture, vocab_size=120, hidden_size=64,
        intermediate_size=ffn, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=16, qkv_bias=qkv_bias, qk_norm=qk_norm, tie_word_embeddings=tie, max_position_embeddings=64)


# Between them the configs cover, on the meshes above: H divisible by P (16 heads), H not
# divisible by P (9 heads like SmolLM2, 4 heads at P = 8), n_kv_heads < P (3 and 1 KV
# heads), n_kv_heads = 1, QKV bias, Qwen3's q/k norms (over padded heads and a KV head
# duplicated into every block), tied embeddings, and vocabulary and FFN sizes that need
# padding at P = 8 (120, 100).
CONFIGS = {
    "16_heads_8_kv": tiny(16, 8),
    "9_heads_3_kv_bias": tiny(9, 3, qkv_bias=True, ffn=100),
    "4_heads_1_kv_tied_qk_norm": tiny(4, 1, qk_norm=True, tie=True),
}


def assert_replicated(array: jax.Array, what: str) -> np.ndarray:
    """Every addressable shard of a replicated array holds the same bytes; returns them."""
    assert array.sharding.is_fully_replicated, f"{what}: not replicated ({array.sharding})"
    shards = array.addressable_shards
    first = np.asarray(shards[0].data)
    for shard in shards[1:]:
        data = np.asarray(shard.data)
        assert data.tobytes() == first.tobytes(), (
            f"{what}: device {shard.device.id} holds other values than device {shards[0].device.id} "
            f"(max difference {np.abs(data.astype(np.float64) - first).max():.3g})")
    return first


@pytest.fixture
def shard_checked_steps(monkeypatch):
    """Makes ``run_scenario``'s steps check every shard of their replicated outputs;
    returns the number of shards checked per step."""
    checked = []
    make_step = stepping.make_step

    def make_checked_step(weights, mode, *args, **kwargs):
        step = make_step(weights, mode, *args, **kwargs)

        def checked_step(params, caches, batch):
            out, caches = step(params, caches, batch)
            assert_replicated(out.packed, f"{mode} mode, sampled tokens")
            assert_replicated(out.logits, f"{mode} mode, logits")
            checked.append(len(out.packed.addressable_shards))
            return out, caches

        return checked_step

    monkeypatch.setattr(stepping, "make_step", make_checked_step)
    return checked


def transformers_model(params, config: ModelConfig):
    """A transformers Llama with these canonical weights (QKV bias as ``attention_bias``
    with a zero o_proj bias), or a Qwen3 for q/k norms: the oracle for the single-device model."""
    import transformers

    # transformers refuses a hidden size that the head count does not divide (64 and 9
    # heads) even with head_dim given; the head counts are set after its check.
    config_class, model_class = transformers.LlamaConfig, transformers.LlamaForCausalLM
    if config.qk_norm:
        config_class, model_class = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    hf_config = config_class(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=1, num_key_value_heads=1, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.qkv_bias)
    hf_config.num_attention_heads, hf_config.num_key_value_heads = config.num_heads, config.num_kv_heads
    model = model_class(hf_config).to(torch.float32).eval()
    t = lambda x: torch.tensor(np.asarray(x, np.float32))  # noqa: E731
    state = {"model.embed_tokens.weight": t(params.embed), "model.norm.weight": t(params.final_norm)}
    state["lm_head.weight"] = t(params.embed if params.lm_head is None else np.asarray(params.lm_head).T)
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj", "bq": "self_attn.q_proj", "bk": "self_attn.k_proj",
             "bv": "self_attn.v_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    for layer in range(config.num_layers):
        for field, module in names.items():
            value = getattr(params.layers, field)
            if value is None:
                continue
            value = np.asarray(value[layer])
            kind = "bias" if field in ("bq", "bk", "bv") else "weight"
            state[f"model.layers.{layer}.{module}.{kind}"] = t(value.T if value.ndim == 2 else value)
        if config.qkv_bias:
            state[f"model.layers.{layer}.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size)
    model.load_state_dict(state, strict=True)
    return model


def transformers_logits_like(step_logits, model, vocab_size):
    """transformers' logits at every (step, row) of the scenario, shaped like ``step_logits``."""
    tokens, where = {0: [], 1: []}, {0: [], 1: []}
    for step, chunks in enumerate(stepping.scenario(vocab_size)):
        for row, (seq, chunk) in enumerate(chunks):
            tokens[seq] += chunk
            where[seq].append((step, row, len(tokens[seq]) - 1))
    expected = [np.zeros_like(logits) for logits in step_logits]
    for seq in (0, 1):
        with torch.no_grad():
            logits = model(torch.tensor([tokens[seq]])).logits[0].numpy()
        for step, row, position in where[seq]:
            expected[step][row] = logits[position]
    return expected


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


def relative_error(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_single_device_matches_transformers(name, single_device_logits):
    params, logits = single_device_logits(name)
    expected = transformers_logits_like(logits, transformers_model(params, CONFIGS[name]), CONFIGS[name].vocab_size)
    for step, (got, want) in enumerate(zip(logits, expected)):
        assert relative_error(got, want) < 1e-4, f"step {step}: relative error {relative_error(got, want):.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sp,tp", MESHES)
def test_modes_match_single_device(name, sp, tp, single_device_logits, shard_checked_steps):
    params, expected = single_device_logits(name)
    # With sp == 1 SP mode is TP mode, so only TP mode runs there.
    runs = {"tp": ["tp"], "sp": ["sp"]} if sp > 1 else {"tp": ["tp"]}
    results, _ = run_scenario(params, CONFIGS[name], sp, tp, runs)
    for mode, (logits, _) in results.items():
        for step, (got, want) in enumerate(zip(logits, expected)):
            error = relative_error(got, want)
            assert error < 1e-5, f"{mode} mode, step {step}: relative error {error:.2e}"
    # Every step on every device (the single-device oracle may have run here too, on 1).
    assert shard_checked_steps.count(sp * tp) == len(runs) * len(expected)


def test_the_shard_check_rejects_a_differing_shard():
    mesh = make_mesh(2, 4)
    replicated = NamedSharding(mesh, P())
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    same = jax.device_put(value, replicated)
    np.testing.assert_array_equal(assert_replicated(same, "equal shards"), value)
    # What check_vma=False lets through: out_specs say replicated, one device disagrees.
    buffers = [jax.device_put(value + (d == mesh.devices.flat[5]) * 1e-6, d) for d in mesh.devices.flat]
    differing = jax.make_array_from_single_device_arrays(value.shape, replicated, buffers)
    assert np.array_equal(np.asarray(differing), value)  # reading one shard sees nothing wrong
    with pytest.raises(AssertionError, match=f"device {mesh.devices.flat[5].id} holds other values"):
        assert_replicated(differing, "one device off by 1e-6")
    # A shard_map that claims a device-dependent value is replicated is caught the same way.
    claims_replicated = jax.jit(jax.shard_map(lambda x: x + jax.lax.axis_index("tp"), mesh=mesh,
                                              in_specs=P(), out_specs=P(), check_vma=False))
    with pytest.raises(AssertionError, match="holds other values"):
        assert_replicated(claims_replicated(same), "device-dependent output")


@pytest.mark.parametrize("sp,tp", [(2, 2), (4, 2)])
def test_two_copies_storage_equals_aliased(sp, tp, single_device_logits, shard_checked_steps):
    name = "9_heads_3_kv_bias"
    params, expected = single_device_logits(name)
    runs = {"tp": ["tp"], "sp": ["sp"], "alternate": ["tp", "sp"]}
    aliased, aliased_weights = run_scenario(params, CONFIGS[name], sp, tp, runs)
    copies, copies_weights = run_scenario(params, CONFIGS[name], sp, tp, runs, storage="two_copies")
    # The option took effect: SP mode reads sp blocks (aliased) or one contiguous array.
    assert isinstance(aliased_weights.sp.layers.wqkv, tuple)
    assert not isinstance(copies_weights.sp.layers.wqkv, tuple)
    for run in runs:
        (aliased_logits, aliased_caches), (copies_logits, copies_caches) = aliased[run], copies[run]
        for step, (a, c, want) in enumerate(zip(aliased_logits, copies_logits, expected)):
            # SP mode sums one GEMM instead of sp block GEMMs: equal up to rounding.
            assert relative_error(c, a) < 1e-5, f"{run}, step {step}: {relative_error(c, a):.2e}"
            assert relative_error(c, want) < 1e-5, f"{run}, step {step}: two copies vs one device"
            np.testing.assert_array_equal(c.argmax(-1), a.argmax(-1))
        for kind in ("k", "v"):
            a, c = np.asarray(getattr(aliased_caches, kind)), np.asarray(getattr(copies_caches, kind))
            np.testing.assert_allclose(c, a, rtol=0, atol=1e-5 * np.abs(a).max(), err_msg=f"{run} {kind} cache")
    assert shard_checked_steps.count(sp * tp) == 2 * len(runs) * len(expected)
