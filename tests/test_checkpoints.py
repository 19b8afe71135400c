"""HF safetensors → Orbax conversion, restore, tokenizer, and the errors of bad checkpoints."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from hf_tiny import hf_state_dict_numpy, make_tiny_hf_checkpoint
from shiftjax.checkpoints import CheckpointError, convert_hf_checkpoint, load_checkpoint, load_tokenizer
from shiftjax.checkpoints.cli import convert_main
from shiftjax.params import param_shapes

# canonical field → (HF per-layer suffix, transposed)
LAYER_FIELDS = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def expected_canonical(hf: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """The canonical tensors, built the obvious way from the HF state dict."""
    flat = {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        flat["lm_head"] = hf["lm_head.weight"].T
    for field, (suffix, transpose) in LAYER_FIELDS.items():
        names = [f"model.layers.{i}.{suffix}" for i in range(num_layers)]
        if names[0] in hf:
            flat[f"layers.{field}"] = np.stack([hf[n].T if transpose else hf[n] for n in names])
    return flat


def flat_params(params) -> dict[str, np.ndarray]:
    from shiftjax.params import params_to_flat

    return {k: np.asarray(v) for k, v in params_to_flat(params).items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny HF checkpoints, built once: ``tiny(kind, shards) -> (hf_dir, hf_state_dict)``."""
    cache = {}

    def get(kind, shards=1):
        if (kind, shards) not in cache:
            directory = tmp_path_factory.mktemp(f"hf-{kind}-{shards}")
            hf_dir, model = make_tiny_hf_checkpoint(
                directory, kind, num_shards=shards, with_tokenizer=kind == "llama"
            )
            # Tied models report lm_head.weight in the state dict; the file does not have it.
            state = hf_state_dict_numpy(model)
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            cache[kind, shards] = hf_dir, state
        return cache[kind, shards]

    return get


def copy_hf(tiny, tmp_path, kind="llama", shards=1):
    """A private, editable copy of a tiny HF checkpoint."""
    src, state = tiny(kind, shards)
    dst = tmp_path / f"hf-{kind}"
    shutil.copytree(src, dst)
    return dst, state


@pytest.mark.parametrize("kind,shards", [("llama", 1), ("llama", 2), ("qwen2", 2), ("tied", 1)])
def test_round_trip_is_bit_exact(tiny, tmp_path, kind, shards):
    hf_dir, state = tiny(kind, shards)
    out = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    config, params = load_checkpoint(out)
    assert set(param_shapes(config)) == set(flat_params(params))
    expected = expected_canonical(state, config.num_layers)
    got = flat_params(params)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert config.qkv_bias == (kind == "qwen2")
    assert config.tie_word_embeddings == (kind == "tied")
    assert (config.rope_scaling is not None) == (kind == "llama")
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert not list(tmp_path.glob(".ckpt*")), "staging directory left behind"


def test_bfloat16_convert_and_dtype_on_load(tiny, tmp_path):
    hf_dir, state = tiny("qwen2", 2)
    out = convert_hf_checkpoint(hf_dir, tmp_path / "bf16")  # bfloat16 is the default
    config, params = load_checkpoint(out)
    expected = expected_canonical(state, config.num_layers)
    for name, value in flat_params(params).items():
        assert value.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(value, expected[name].astype(ml_dtypes.bfloat16), err_msg=name)
    _, as_f32 = load_checkpoint(out, dtype="float32")
    assert as_f32.layers.wq.dtype == np.float32


def test_restore_into_shardings(tiny, tmp_path):
    hf_dir, state = tiny("llama")
    out = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    mesh = jax.make_mesh((len(jax.devices()),), ("tp",))
    n = mesh.shape["tp"]
    from shiftjax.checkpoints.load import load_config

    shapes = param_shapes(load_config(out))
    specs = {path: P(*([None] * (len(shape) - 1)), "tp") if shape[-1] % n == 0 else P()
             for path, shape in shapes.items()}
    shardings = {path: NamedSharding(mesh, spec) for path, spec in specs.items()}
    config, params = load_checkpoint(out, shardings=shardings)
    got = flat_params(params)
    expected = expected_canonical(state, config.num_layers)
    from shiftjax.params import params_to_flat

    for path, array in params_to_flat(params).items():
        assert array.sharding.spec == specs[path], path
        np.testing.assert_array_equal(got[path], expected[path])
    assert specs["layers.wq"] == P(None, None, "tp")
    assert len(params.layers.wq.addressable_shards) == n


def test_tokenizer_and_chat_template_are_carried(tiny, tmp_path):
    hf_dir, _ = tiny("llama")
    out = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    tokenizer = load_tokenizer(out)
    assert tokenizer.encode("w5 w6 w7") == [1, 5, 6, 7]
    assert tokenizer.encode("w5 w6 w7", add_special_tokens=False) == [5, 6, 7]
    assert tokenizer.decode([1, 5, 6, 2]) == "w5 w6"
    assert tokenizer.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "w5 w6"}]
    assert tokenizer.apply_chat_template(messages) == "<s><user> w5 w6 </s><assistant>"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == "<s><user> w5 w6 </s>"
    with pytest.raises(Exception, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_checkpoint_without_tokenizer(tiny, tmp_path):
    hf_dir, _ = tiny("tied")
    out = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(out)


def rewrite_single_file(hf_dir, edit):
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def assert_convert_fails(hf_dir, out, match):
    with pytest.raises(CheckpointError, match=match):
        convert_hf_checkpoint(hf_dir, out, dtype="float32")
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), "staging directory left behind"


def test_missing_tensor_is_named(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path)
    rewrite_single_file(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert_convert_fails(hf_dir, tmp_path / "out", r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing")


def test_wrong_shape_is_named(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path)

    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]

    rewrite_single_file(hf_dir, shrink)
    assert_convert_fails(hf_dir, tmp_path / "out", r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape \[31, 64\]")


def test_truncated_shard_is_named(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path, shards=2)
    shard = hf_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_convert_fails(hf_dir, tmp_path / "out", r"model-00002-of-00002\.safetensors is truncated: tensor '")


def test_mismatched_index_is_named(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path, shards=2)
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, file_name = next(iter(index["weight_map"].items()))
    other = next(f for f in set(index["weight_map"].values()) if f != file_name)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    assert_convert_fails(hf_dir, tmp_path / "out", f"index mismatch: tensor '{name}'")


def test_garbage_config(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path)
    (hf_dir / "config.json").write_text("{not json")
    assert_convert_fails(hf_dir, tmp_path / "out", "config.json is not valid JSON")
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    assert_convert_fails(hf_dir, tmp_path / "out", "config.json.*num_attention_heads")


def test_unknown_dtype_and_extra_tensors(tiny, tmp_path):
    hf_dir, _ = copy_hf(tiny, tmp_path)
    original = load_file(hf_dir / "model.safetensors")

    def to_int8(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)

    rewrite_single_file(hf_dir, to_int8)
    assert_convert_fails(hf_dir, tmp_path / "out", r"'model\.norm\.weight'.*dtype I8")

    save_file(dict(original, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
              hf_dir / "model.safetensors")
    assert_convert_fails(hf_dir, tmp_path / "out", r"unexpected tensors 'model\.layers\.0\.self_attn\.o_proj\.bias'")

    # Rotary inv_freq buffers carry nothing the config does not: ignored.
    save_file(dict(original, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}),
              hf_dir / "model.safetensors")
    assert convert_hf_checkpoint(hf_dir, tmp_path / "out", dtype="float32").is_dir()


def test_tied_checkpoint_with_saved_head_and_stray_files(tiny, tmp_path):
    hf_dir, state = copy_hf(tiny, tmp_path, kind="tied")
    # Some exporters save the tied head anyway; the embedding stays the truth.
    rewrite_single_file(hf_dir, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    # Mistral repositories ship consolidated.safetensors beside model.safetensors.
    save_file({"tok_embeddings.weight": np.zeros((4, 4), np.float32)}, hf_dir / "consolidated.safetensors")
    config, params = load_checkpoint(convert_hf_checkpoint(hf_dir, tmp_path / "out", dtype="float32"))
    assert params.lm_head is None
    np.testing.assert_array_equal(np.asarray(params.embed), state["model.embed_tokens.weight"])


def test_failure_while_writing_leaves_nothing(tiny, tmp_path, monkeypatch):
    from shiftjax.checkpoints import convert

    def explode(flat, params_dir):
        params_dir.mkdir()
        raise OSError("disk full")

    monkeypatch.setattr(convert, "save_params", explode)
    hf_dir, _ = tiny("tied")
    with pytest.raises(OSError, match="disk full"):
        convert_hf_checkpoint(hf_dir, tmp_path / "out", dtype="float32")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_and_not_a_checkpoint(tiny, tmp_path):
    hf_dir, _ = tiny("tied")
    out = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf_checkpoint(hf_dir, out, dtype="float32")
    assert convert_hf_checkpoint(hf_dir, out, dtype="bfloat16", overwrite=True) == out
    assert load_checkpoint(out)[1].embed.dtype == ml_dtypes.bfloat16

    with pytest.raises(CheckpointError, match="not a complete shiftjax checkpoint"):
        load_checkpoint(hf_dir)
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    (partial / "shiftjax.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete shiftjax checkpoint"):
        load_checkpoint(partial)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "nowhere")


def test_convert_cli(tiny, tmp_path, capsys):
    hf_dir, _ = tiny("tied")
    assert convert_main([str(hf_dir), str(tmp_path / "ckpt"), "--dtype", "float32"]) == 0
    assert load_checkpoint(tmp_path / "ckpt")[1].embed.dtype == np.float32
    assert convert_main([str(tmp_path / "nowhere"), str(tmp_path / "ckpt2")]) == 2
    assert "nowhere is not a directory" in capsys.readouterr().err
