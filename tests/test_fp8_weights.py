"""FP8 weights (``--quantization fp8``): quantized as data in the block layout, the same
arithmetic in TP, SP and alternating steps, compressed-tensors checkpoints read and refused."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import stepping
from hf_tiny import make_tiny_hf_checkpoint
from stepping import run_scenario
from test_invariance import CONFIG

from shiftjax.batch import empty_batch
from shiftjax.checkpoints.convert import convert_hf_checkpoint
from shiftjax.checkpoints.format import CheckpointError, read_marker
from shiftjax.checkpoints.load import restore_weights
from shiftjax.kernels.fp8_gemm import Fp8GemmChoice
from shiftjax.layouts.mesh import make_mesh
from shiftjax.model import Context, run_layers
from shiftjax.params import random_params
from shiftjax.quantization import Fp8Weight, dequantize, empty_fp8_blocks, quantize_blocks
from shiftjax.weights import shard_params


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=3)


@pytest.mark.parametrize("algorithm_cut", [64, 0], ids=["w8a16", "w8a8"])
def test_tp_sp_and_alternate_give_identical_fp8_logits_and_pages(params, algorithm_cut):
    runs = {"tp": ["tp"], "sp": ["sp"], "alternate": ["tp", "sp"], "alternate_sp_first": ["sp", "tp"]}
    results, weights = run_scenario(params, CONFIG, 2, 2, runs, quantization="fp8",
                                    fp8_gemm=Fp8GemmChoice(w8a16_max_tokens=algorithm_cut))
    assert isinstance(weights.tp.layers.w_down, Fp8Weight) and weights.tp.layers.w_down.values.dtype == jnp.float8_e4m3fn
    want_logits, want_caches = results["tp"]
    for name, (logits, caches) in results.items():
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            assert got.tobytes() == want.tobytes(), f"{name} step {step}: logits differ from TP mode's"
        assert np.asarray(caches.k).tobytes() == np.asarray(want_caches.k).tobytes(), name
        assert np.asarray(caches.v).tobytes() == np.asarray(want_caches.v).tobytes(), name
    # quantized, not bf16 by another name: the logits move, a little
    plain, _ = run_scenario(params, CONFIG, 2, 2, {"tp": ["tp"]})
    for got, want in zip(want_logits, plain["tp"][0]):
        error = np.abs(got - want).max() / np.abs(want).max()
        assert 1e-4 < error < 0.1, error


def test_unrolled_fp8_layers_equal_the_scan(params):
    """Unrolled, each layer's FP8 weights are sliced statically (or, on the GPU's decode
    kernel, bound to the stack); the scan slices them dynamically. Same weights, same
    logits; and TP and SP mode still agree bit for bit."""
    runs = {"tp": ["tp"], "alternate": ["tp", "sp"]}
    choice = Fp8GemmChoice(w8a16_max_tokens=64)
    unrolled, _ = run_scenario(params, CONFIG, 2, 2, runs, quantization="fp8", layer_loop="unrolled", fp8_gemm=choice)
    scanned, _ = run_scenario(params, CONFIG, 2, 2, {"tp": ["tp"]}, quantization="fp8", fp8_gemm=choice)
    for got, want in zip(unrolled["alternate"][0], unrolled["tp"][0]):
        assert got.tobytes() == want.tobytes()
    for got, want in zip(unrolled["tp"][0], scanned["tp"][0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("tokens,quantized_gemm,bound", [(16, "pallas", True), (128, "pallas", True),
                                                         (16, "reference", False)])
def test_unrolled_fp8_weights_stay_stacked_for_the_kernels_that_read_the_stack(params, tokens, quantized_gemm, bound):
    """The Pallas kernels read their layer out of the stacked weights (a custom call's
    sliced operand is copied on the GPU); the reference gets its layer sliced statically,
    as bf16 weights are, which XLA's GEMMs read where they lie."""
    weights = shard_params(params, CONFIG, make_mesh(1, 1), "aliased", "fp8")
    layers, stacked = weights.tp.layers, weights.tp.layers.wo
    ctx = Context(dims=weights.dims, eps=1e-6, inv_freq=None, batch=empty_batch(tokens, 2, 4),
                  attention="reference", quantized_gemm=quantized_gemm)
    seen = []

    def layer_fn(x, weights, k_cache, v_cache, index, ctx):
        wo = weights.wo
        seen.append((wo.layer is not None, wo.values.shape))
        scale = wo.scale if wo.layer is None else jax.lax.dynamic_index_in_dim(wo.scale, wo.layer, keepdims=False)
        return x + scale[0, 0], k_cache, v_cache

    x, _, _ = run_layers(layer_fn, jnp.zeros(()), layers, jnp.zeros(()), jnp.zeros(()), ctx, unrolled=True)
    assert float(x) == pytest.approx(float(jnp.sum(stacked.scale[:, 0, 0])), rel=1e-6)  # each layer's own
    assert ctx.fp8_reads_stacked_layers == bound
    assert set(seen) == {(bound, stacked.values.shape if bound else stacked.values.shape[1:])}


@pytest.mark.parametrize("sp,tp", [(2, 2), (1, 2), (1, 1)])
def test_aliased_views_hold_one_copy_of_the_fp8_weights(params, sp, tp):
    weights = shard_params(params, CONFIG, make_mesh(sp, tp), "aliased", "fp8")
    for name in ("wqkv", "w_down"):
        tp_view, sp_view = getattr(weights.tp.layers, name), getattr(weights.sp.layers, name)
        for field in ("values", "scale"):
            tp_buffers = {s.data.unsafe_buffer_pointer() for s in getattr(tp_view, field).addressable_shards}
            sp_buffers = {s.data.unsafe_buffer_pointer() for part in sp_view
                          for s in getattr(part, field).addressable_shards}
            assert tp_buffers <= sp_buffers, (name, field)  # TP mode reads the SP shards' own bytes


def test_scales_are_per_output_channel_and_do_not_depend_on_the_mesh(params):
    """A row weight's channel absmax spans every block; a column weight's lies in one."""
    canonical_down = np.asarray(params.layers.w_down)  # [layers, d_ff, d_model]
    want = np.abs(canonical_down).max(axis=1) / 448.0
    for sp, tp in ((1, 1), (2, 2), (8, 1)):
        weights = shard_params(params, CONFIG, make_mesh(sp, tp), "aliased", "fp8")
        scale = np.asarray(weights.tp.layers.w_down.scale)  # [layers, P, d_model]
        for block in range(scale.shape[1]):
            np.testing.assert_allclose(scale[:, block], want, rtol=1e-6)
    one = shard_params(params, CONFIG, make_mesh(1, 1), "aliased", "fp8")
    w = np.asarray(dequantize(one.tp.layers.w_gate_up))[:, 0]  # [layers, d_model, 2 * d_ff]
    canonical = np.concatenate([np.asarray(params.layers.w_gate), np.asarray(params.layers.w_up)], axis=-1)
    # e4m3 keeps 3 mantissa bits: each weight within half a step of its channel's grid
    assert np.all(np.abs(w - canonical) <= np.abs(canonical).max(axis=1, keepdims=True) / 448 * 16 + 1e-7)
    assert np.abs(w - canonical).max() > 0


def test_fp8_needs_aliased_storage_and_a_known_name(params):
    with pytest.raises(ValueError, match="needs weight storage 'aliased'"):
        shard_params(params, CONFIG, make_mesh(2, 2), "two_copies", "fp8")
    with pytest.raises(ValueError, match="quantization must be one of none, fp8, got 'int4'"):
        shard_params(params, CONFIG, make_mesh(1, 1), "aliased", "int4")


def test_the_cli_lists_the_valid_quantizations_and_refuses_fp8_with_two_copies():
    done = subprocess.run([sys.executable, "-m", "shiftjax.serving.cli", "serve", "--quantization", "int4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--quantization: invalid choice: 'int4' (choose from 'none', 'fp8')" in done.stderr.replace('"', "'")
    done = subprocess.run([sys.executable, "-m", "shiftjax.serving.cli", "serve", "--quantization", "fp8",
                           "--weight-storage", "two_copies"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--quantization fp8 needs --weight-storage aliased" in done.stderr


# --- compressed-tensors checkpoints ------------------------------------------------------

GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file written by hand (safetensors' numpy API has no float8 reader to
    check against, and this is the byte layout the format specifies)."""
    codes = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float32): "F32"}
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": codes[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def make_fp8_checkpoint(tmp_path, *, strategy="channel", drop_scale=None, bad_scale=None):
    """The tiny HF model with every layer GEMM quantized as compressed-tensors stores it."""
    from safetensors.numpy import load_file

    hf_dir, _ = make_tiny_hf_checkpoint(tmp_path / "hf")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    out, quantized = {}, {}
    for name, value in tensors.items():
        if not any(f".{g}.weight" in name for g in GEMMS):
            out[name] = value
            continue
        absmax = np.abs(value).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(value).max().reshape(1)
        scale = (absmax / 448.0).astype(np.float32)
        values = (value / scale.reshape(-1, 1) if strategy == "channel" else value / scale).astype(ml_dtypes.float8_e4m3fn)
        out[name] = values
        quantized[name] = (values, scale)
        if name != drop_scale:
            out[name + "_scale"] = scale if name != bad_scale else np.ones((3,), np.float32)
        out[name.replace(".weight", ".input_scale")] = np.ones((1,), np.float32)
    (hf_dir / "model.safetensors").unlink()
    _write_safetensors(hf_dir / "model.safetensors", out)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                                      "input_activations": {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "token"}}}}
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir, quantized


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_compressed_tensors_checkpoint_loads_back_its_own_fp8_values(tmp_path, dtype):
    hf_dir, quantized = make_fp8_checkpoint(tmp_path)
    converted = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype=dtype)
    assert read_marker(converted)["quantization"]["method"] == "fp8"
    config, weights = restore_weights(converted, mesh=make_mesh(1, 1))  # fp8: the checkpoint says so
    assert weights.quantization == "fp8"
    down = weights.tp.layers.w_down  # values [layers, 1, d_model, d_ff], as HF's [out, in]
    for layer in range(config.num_layers):
        values, scale = quantized[f"model.layers.{layer}.mlp.down_proj.weight"]
        got = np.asarray(down.values[layer, 0]).astype(np.float32)
        np.testing.assert_array_equal(got, values.astype(np.float32))  # the checkpoint's own e4m3 values
        # float32 storage keeps the scale to its last bits; bf16 storage to a bf16 rounding
        np.testing.assert_allclose(np.asarray(down.scale[layer, 0]), scale[:, 0],
                                   rtol=1e-6 if dtype == "float32" else 2 ** -8)
    _, plain = restore_weights(converted, mesh=make_mesh(1, 1), quantization="none")
    assert plain.quantization == "none" and not isinstance(plain.tp.layers.w_down, Fp8Weight)
    with pytest.raises(CheckpointError, match="served fp8, which needs --weight-storage aliased.*--quantization none"):
        restore_weights(converted, mesh=make_mesh(1, 1), weight_storage="two_copies")


def test_a_missing_scale_is_refused_with_its_name(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    hf_dir, _ = make_fp8_checkpoint(tmp_path, drop_scale=name)
    with pytest.raises(CheckpointError, match=f"'{name}' is FP8 but its scale '{name}_scale' is missing"):
        convert_hf_checkpoint(hf_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_scale_of_the_wrong_shape_is_refused_with_its_name(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    hf_dir, _ = make_fp8_checkpoint(tmp_path, bad_scale=name)
    with pytest.raises(CheckpointError, match=rf"'{name}_scale' has shape \[3\].*per output channel"):
        convert_hf_checkpoint(hf_dir, tmp_path / "ckpt")


def test_per_tensor_scales_and_unknown_methods(tmp_path):
    hf_dir, quantized = make_fp8_checkpoint(tmp_path, strategy="tensor")
    converted = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    _, weights = restore_weights(converted, mesh=make_mesh(1, 1))
    values, scale = quantized["model.layers.0.self_attn.o_proj.weight"]
    got = np.asarray(dequantize(weights.tp.layers.wo))[0, 0]  # [q_features, d_model]
    want = values.astype(np.float32).T * scale
    # per-channel scales on a per-tensor grid: within half an e4m3 step of the checkpoint
    assert np.abs(got - want).max() <= np.abs(want).max() / 16
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='gptq' is not supported"):
        convert_hf_checkpoint(hf_dir, tmp_path / "ckpt2")


def test_an_fp8_tensor_without_a_quantization_config_is_refused(tmp_path):
    hf_dir, _ = make_fp8_checkpoint(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    del config["quantization_config"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is F8_E4M3, but config.json has no quantization_config"):
        convert_hf_checkpoint(hf_dir, tmp_path / "ckpt")


def test_quantize_blocks_fills_the_outputs_made_before_the_blocks():
    """``empty_fp8_blocks`` made first, then filled: the same values as made after, and
    outputs that do not fit the blocks are refused."""
    blocks = jax.random.normal(jax.random.key(0), (3, 2, 16, 8), jnp.bfloat16)
    want = quantize_blocks(blocks, "row")
    got = quantize_blocks(blocks, "row", empty_fp8_blocks(blocks.shape, blocks.sharding))
    assert np.asarray(got.values).tobytes() == np.asarray(want.values).tobytes()
    assert np.asarray(got.scale).tobytes() == np.asarray(want.scale).tobytes()
    with pytest.raises(ValueError, match="do not fit"):
        quantize_blocks(blocks, "row", empty_fp8_blocks((3, 2, 8, 16), blocks.sharding))
