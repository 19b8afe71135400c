"""``--load-format dummy``: random weights made on the devices in their final shardings."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from stepping import build_batch, scenario
from test_sharded_restore import QWEN_HF, SMOL_HF, assert_same_weights, held_bytes_per_device, weight_leaves

from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.checkpoints import dummy
from shiftjax.checkpoints.format import CheckpointError
from shiftjax.checkpoints.load import load_weights, restore_weights, tokenizer_path_for
from shiftjax.config import ModelConfig
from shiftjax.layouts import blocks as blk
from shiftjax.layouts.heads import head_layout
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import param_shapes
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step, params_for
from shiftjax.weights import block_plan, shard_params

SMOL = ModelConfig.from_hf_dict(SMOL_HF)
QWEN = ModelConfig.from_hf_dict(QWEN_HF)
# Qwen3: q/k norm weights, replicated beside the other norms
QWEN3 = ModelConfig.from_hf_dict(QWEN_HF | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 12})
CONFIGS = {"smol": SMOL, "qwen": QWEN, "qwen3": QWEN3}


@pytest.fixture(scope="module")
def canonical():
    """The dummy models' canonical form, made on one device and brought to the host."""
    one = make_mesh(1, 1)
    return {name: jax.device_get(dummy.dummy_params(config, mesh=one, dtype="float32"))
            for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name,sp,tp,storage", [
    ("smol", 1, 1, "aliased"), ("smol", 2, 2, "aliased"), ("smol", 4, 2, "aliased"),
    ("qwen", 1, 4, "aliased"), ("qwen", 2, 2, "two_copies"), ("qwen3", 4, 2, "aliased"),
])
def test_dummy_weights_are_their_canonical_form_expanded(canonical, name, sp, tp, storage):
    """Bit-identical to ``shard_params`` of the canonical dummy model: padded heads and FFN
    columns are zero, duplicated KV heads equal, and the model is the same on every mesh."""
    config = CONFIGS[name]
    mesh = make_mesh(sp, tp)
    made = dummy.dummy_weights(config, mesh=mesh, dtype="float32", weight_storage=storage)
    assert_same_weights(made, shard_params(canonical[name], config, mesh, storage))


def test_canonical_dummy_params_do_not_depend_on_the_mesh(canonical):
    sharded = dummy.dummy_params(SMOL, mesh=make_mesh(4, 2), dtype="float32")
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                 jax.tree_util.tree_leaves(canonical["smol"])):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=jax.tree_util.keystr(path))
    # Matrices are 0.02 * N(0, 1); norms are one.
    assert 0.015 < float(np.std(canonical["smol"].layers.w_gate)) < 0.025
    assert np.all(canonical["smol"].final_norm == 1)
    assert not sharded.layers.wq.sharding.is_fully_replicated  # 72 features over 8 devices


def test_each_device_holds_only_its_shard():
    mesh = make_mesh(4, 2)
    weights = dummy.dummy_weights(SMOL, mesh=mesh, dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in weight_leaves(weights).values())
    held = held_bytes_per_device(weights)
    shapes = param_shapes(SMOL)
    plan = block_plan(SMOL, weights.layout)
    # Aliased storage: sp blocks of each layer weight per device (its TP shard), one of the rest.
    final_bytes = sum(np.prod(w.block_shape(shapes)) * 2 * (4 if w.kind in ("column", "row") else 1)
                      for w in plan.values())
    assert len(held) == 8 and set(held.values()) == {final_bytes}
    canonical_bytes = sum(np.prod(s) * 2 for s in shapes.values())
    assert final_bytes < canonical_bytes


def _generation_memory(num_layers: int) -> dict:
    """XLA's per-device memory analysis of every block program for a (2, 2) mesh."""
    config = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=128, intermediate_size=512,
                         num_layers=num_layers, num_heads=8, num_kv_heads=2, head_dim=16)
    mesh = make_mesh(2, 2)
    shapes = param_shapes(config)
    found = {}
    for weight in block_plan(config, head_layout(8, 2, 2, 2)).values():
        if weight.stacked:
            sharding, positions = blk.shard_sharding(mesh, 4), 2  # aliased A_j: [layers, tp, ...]
        else:
            sharding, positions = jax.sharding.NamedSharding(mesh, P(("tp", "sp"), None)), 4
        program = dummy._block_program(tuple(s.tensor for s in weight.segments), weight.kind, weight.cut_axis,
                                       tuple(shapes.items()), 0, jnp.dtype("bfloat16"), mesh, sharding.spec)
        tables = [jax.ShapeDtypeStruct((positions, s.index.shape[1]), jnp.int32) for s in weight.segments]
        found[weight.name] = (weight, np.prod(weight.block_shape(shapes)),
                              program.lower(*tables).compile().memory_analysis())
    return found


def test_generation_keeps_one_layer_of_temporaries():
    """Peak device memory of the generation, from XLA's per-device memory analysis (the CPU
    has no memory_stats): each program's output is exactly its device's blocks, and its
    temporaries do not grow with depth, so no stack is ever held twice."""
    shallow, deep = _generation_memory(4), _generation_memory(16)
    for name, (weight, block, memory) in deep.items():
        assert memory.output_size_in_bytes == block * 2, name
        if weight.stacked:
            assert memory.temp_size_in_bytes == shallow[name][2].temp_size_in_bytes, name
            assert memory.temp_size_in_bytes < memory.output_size_in_bytes, name
        else:  # vocabulary blocks are made in chunks; the LM head is then transposed once
            assert memory.temp_size_in_bytes <= 2 * memory.output_size_in_bytes, name


def test_dummy_model_runs_both_modes_to_finite_logits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL_HF))
    mesh = make_mesh(2, 2)
    config, weights = load_weights(tmp_path, mesh=mesh, dtype="bfloat16", load_format="dummy")
    assert config == SMOL
    batch = jax.tree.map(jnp.asarray, build_batch(scenario(config.vocab_size)[0], [0, 0]))
    logits = {}
    for mode in ("tp", "sp"):
        caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                                CacheConfig(num_pages=16, page_size=4, dtype="bfloat16"))
        step = make_step(weights, mode, StepOptions(attention="reference"), return_logits=True)
        out, _ = step(params_for(weights, mode), caches, batch)
        logits[mode] = np.asarray(out.logits, np.float32)[:2]
        assert np.all(np.isfinite(logits[mode])), mode
        assert np.std(logits[mode]) > 0, mode
    np.testing.assert_allclose(logits["tp"], logits["sp"], atol=0.05 * np.abs(logits["tp"]).max())


def test_dummy_checkpoint_restores_to_the_dummy_model(tmp_path):
    """A checkpoint written from the canonical dummy model (as benchmarks/restore_gpu.py
    does) restores to exactly the weights ``--load-format dummy`` makes."""
    mesh = make_mesh(2, 2)
    path = dummy.write_checkpoint(dummy.dummy_params(SMOL, mesh=mesh, dtype="bfloat16"), SMOL_HF, tmp_path / "ckpt")
    _, restored = restore_weights(path, mesh=mesh)
    assert_same_weights(restored, dummy.dummy_weights(SMOL, mesh=mesh, dtype="bfloat16"))


def test_load_weights_names_what_is_wrong(tmp_path):
    mesh = make_mesh(1, 1)
    with pytest.raises(CheckpointError, match="config.json"):
        load_weights(tmp_path, mesh=mesh, load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_weights(tmp_path, mesh=mesh, load_format="safetensors")


def test_tokenizer_is_the_default_models_unless_given(tmp_path, monkeypatch):
    import shiftjax.checkpoints.default_model as default_model

    monkeypatch.setattr(default_model, "default_model_path", lambda: tmp_path / "default")
    assert tokenizer_path_for(tmp_path / "config.json", "dummy") == tmp_path / "default"
    assert tokenizer_path_for(tmp_path / "config.json", "dummy", tokenizer=tmp_path / "tok") == tmp_path / "tok"
    assert tokenizer_path_for(tmp_path / "ckpt", "orbax") == tmp_path / "ckpt"
