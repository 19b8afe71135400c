"""Who sums TP mode's partials and who does SP mode's all-to-alls (kernels/collectives.py),
on the CPU mesh: ``xla`` is XLA's collective; ``one_shot`` becomes the kernel's custom call
exactly where it applies (two devices in all, bf16 in whole 16-byte words, within the
receive slot) and XLA's elsewhere; the options reach every layer of the steps, the
executable store's keys and the CLI; a mesh they cannot serve is refused with the reason,
and ``auto`` falls back to XLA's whatever stops the kernel. The kernels themselves run on
two GPUs only: tests/test_collectives_gpu.py."""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shiftjax.cache import CacheGeometry
from shiftjax.config import ModelConfig
from shiftjax.kernels.collectives import (
    DEFAULT_CAPACITY_BYTES,
    EXCHANGE_TARGET,
    TARGET,
    all_reduce,
    all_to_all,
    check_one_shot_ready,
    first_ordinal_of,
    setup_one_shot,
)
from shiftjax.layouts.mesh import SP, TP, make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step
from shiftjax.weights import shard_params

AXES = (SP, TP)
CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(2,))


def _summed(mesh, implementation, x, axes=AXES):
    """``all_reduce`` of each device's own block of ``x`` (split over every mesh axis)."""
    spec = P(tuple(mesh.axis_names))
    fn = jax.jit(jax.shard_map(lambda block: all_reduce(block, axes, implementation), mesh=mesh,
                               in_specs=spec, out_specs=spec, check_vma=False))
    return fn, jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2)])
def test_xla_sums_every_devices_block(shape):
    mesh = make_mesh(*shape, jax.devices()[:shape[0] * shape[1]])
    blocks = np.random.default_rng(0).standard_normal((mesh.size, 3, 8)).astype(np.float32)
    fn, x = _summed(mesh, "xla", blocks.reshape(mesh.size * 3, 8))
    got = np.asarray(fn(x)).reshape(mesh.size, 3, 8)
    for device in range(mesh.size):  # every device holds the sum of all blocks
        np.testing.assert_allclose(got[device], blocks.sum(axis=0), rtol=1e-6, atol=1e-6)


def _lowered_text(shape, dtype, rows, hidden=64, axes=AXES):
    mesh = make_mesh(*shape, jax.devices()[:shape[0] * shape[1]])
    fn, x = _summed(mesh, "one_shot", np.zeros((mesh.size * rows, hidden)).astype(dtype), axes)
    return fn.lower(x).as_text()


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_one_shot_is_the_kernel_on_two_devices(shape):
    text = _lowered_text(shape, jnp.bfloat16, rows=8)
    assert TARGET in text and "all_reduce" not in text.replace(TARGET, "")


@pytest.mark.parametrize("case", [
    dict(shape=(2, 2), dtype=jnp.bfloat16, rows=8),  # four devices: NCCL's psum
    dict(shape=(1, 2), dtype=jnp.float32, rows=8),  # not bf16
    dict(shape=(1, 2), dtype=jnp.bfloat16, rows=1, hidden=12),  # 12 elements: not whole 16-byte words
    dict(shape=(1, 2), dtype=jnp.bfloat16, rows=DEFAULT_CAPACITY_BYTES // 2 // 64 + 1),  # over the buffer
    dict(shape=(2, 2), dtype=jnp.bfloat16, rows=8, axes=(TP,)),  # two devices per group, four in all
])
def test_one_shot_falls_back_to_psum_where_it_does_not_apply(case):
    text = _lowered_text(**case)
    assert TARGET not in text and "all_reduce" in text


def _exchanged_text(shape, dtype, dims, split_axis, axis=SP, first_ordinal=0):
    """The lowered ``all_to_all`` (one_shot) of ``dims`` a device over ``axis``, and the
    output shapes of it and of XLA's."""
    mesh = make_mesh(*shape, jax.devices()[:shape[0] * shape[1]])
    spec = P(axis)
    x = jnp.zeros((mesh.shape[axis] * dims[0], *dims[1:]), dtype)

    def exchanged(implementation):
        return jax.jit(jax.shard_map(lambda b: all_to_all(b, axis, split_axis, implementation, first_ordinal),
                                     mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    lowered = exchanged("one_shot").lower(x)
    return lowered.as_text(), lowered.out_info.shape, jax.eval_shape(exchanged("xla"), x).shape


@pytest.mark.parametrize("shape, axis", [((2, 1), SP), ((1, 2), TP)])
@pytest.mark.parametrize("dims, split_axis", [((8, 2, 48), 1), ((2, 8, 16), 0), ((3, 4, 16), 2)])
def test_one_shot_all_to_all_is_the_kernel_on_two_devices(shape, axis, dims, split_axis):
    text, got, want = _exchanged_text(shape, jnp.bfloat16, dims, split_axis, axis)
    assert EXCHANGE_TARGET in text and "all_to_all" not in text.replace(EXCHANGE_TARGET, "")
    assert got == want  # the kernel's [2][outer][inner] reshaped as XLA's all-to-all lays it out


@pytest.mark.parametrize("case", [
    dict(shape=(2, 2), dtype=jnp.bfloat16, dims=(8, 2, 48), split_axis=1),  # four devices: NCCL's
    dict(shape=(2, 1), dtype=jnp.float32, dims=(8, 2, 48), split_axis=1),  # not bf16
    dict(shape=(2, 1), dtype=jnp.bfloat16, dims=(8, 2, 12), split_axis=1),  # rows of 12: not whole 16-byte words
    dict(shape=(2, 1), dtype=jnp.bfloat16, dims=(2, DEFAULT_CAPACITY_BYTES // 2 // 64 + 1, 64), split_axis=0),
])
def test_one_shot_all_to_all_falls_back_to_xla_where_it_does_not_apply(case):
    text, got, want = _exchanged_text(**case)
    assert EXCHANGE_TARGET not in text and "all_to_all" in text and got == want


def test_one_shot_all_to_all_needs_the_first_ordinal():
    with pytest.raises(ValueError, match="needs first_ordinal"):
        _exchanged_text((2, 1), jnp.bfloat16, (8, 2, 48), 1, first_ordinal=None)


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_steps_sum_every_layer_by_the_kernel(mode):
    """Two GEMM partials a layer (attention out, MLP down) go through the kernel, in both
    modes over the (1, 2) mesh (SP mode's sums are over tp there); the embedding's one sum
    a step stays XLA's."""
    config = CONFIG
    weights = shard_params(random_params(config, seed=1, scale=0.3, dtype=jnp.bfloat16), config,
                           make_mesh(1, 2, jax.devices()[:2]))
    from shiftjax.serving.engine import compile as compiling  # the engine's lowering of a bucket

    options = StepOptions(max_pages=4, attention="reference", layer_loop="unrolled", max_top_logprobs=0,
                          sample_in_step=False, all_reduce="one_shot")
    lowered = compiling._lower_steps(weights, _abstract_caches(weights), [(mode, 8, 4)], options, result_rows=4)
    text = lowered[(mode, 8, 4)].as_text()
    # the layer is lowered once and called for every layer (model.run_layers): its two sums
    assert text.count(f"custom_call @{TARGET}") == 2, text.count(TARGET)
    assert text.count("call @layer") + text.count("call @jit_layer") >= config.num_layers


def test_sp_steps_exchange_every_layer_by_the_kernel():
    """SP mode's two all-to-alls a layer (q|k|v blocks out, attention back) go through the
    kernel on the (2, 1) mesh, the first device's ordinal baked in; TP mode has none."""
    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3, dtype=jnp.bfloat16), CONFIG,
                           make_mesh(2, 1, jax.devices()[:2][::-1]))
    from shiftjax.serving.engine import compile as compiling

    options = StepOptions(max_pages=4, attention="reference", layer_loop="unrolled", max_top_logprobs=0,
                          sample_in_step=False, all_to_all="one_shot")
    lowered = compiling._lower_steps(weights, _abstract_caches(weights), [("sp", 8, 4), ("tp", 8, 4)], options,
                                     result_rows=4)
    sp, tp = (lowered[(mode, 8, 4)].as_text() for mode in ("sp", "tp"))
    assert sp.count(f"custom_call @{EXCHANGE_TARGET}") == 2 and "all_to_all" not in sp.replace(EXCHANGE_TARGET, "")
    assert f"first_ordinal = {first_ordinal_of(weights.mesh)} : i64" in sp and first_ordinal_of(weights.mesh) == 1
    assert EXCHANGE_TARGET not in tp


def _abstract_caches(weights):
    return CacheGeometry(CONFIG.num_layers, weights.layout.kv_slots, 4, CONFIG.head_dim, "bfloat16").abstract(weights.mesh)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_make_step_refuses_an_unknown_collective(collective):
    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(1, 2, jax.devices()[:2]))
    with pytest.raises(ValueError, match=f"{collective} must be one of"):
        make_step(weights, "tp", StepOptions(**{collective: "nccl"}))


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_engine_config_refuses_an_unknown_collective(collective):
    with pytest.raises(ValueError, match=f"{collective} must be one of auto, xla, one_shot"):
        EngineConfig(**{collective: "nccl"})


@pytest.mark.parametrize("asked", ["auto", "xla"])
def test_auto_and_xla_choose_xla_off_two_gpus(asked):
    """``auto`` (the default) takes XLA's collectives on CPUs, without trying to build the kernels."""
    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(1, 2, jax.devices()[:2]))
    heard = []
    engine = Engine(weights, EngineConfig(max_model_len=32, page_size=4, num_pages=16, max_num_seqs=2,
                                          max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(2,),
                                          attention="reference", all_reduce=asked, all_to_all=asked),
                    report=heard.append)
    assert engine.all_reduce == engine.all_to_all == "xla"
    assert not any(name.endswith("_setup") for name in engine.startup_seconds)
    assert not any("one-shot" in line for line in heard)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_one_shot_needs_two_gpus(collective):
    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(2, 2))
    options = dict(max_model_len=32, page_size=4, num_pages=16, max_num_seqs=2, max_num_batched_tokens=8,
                   token_buckets=(8,), seq_buckets=(2,), attention="reference", **{collective: "one_shot"})
    with pytest.raises(ValueError, match="two GPUs; this mesh has 4 devices"):
        Engine(weights, EngineConfig(**options))
    two_cpus = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(2, 1, jax.devices()[:2]))
    with pytest.raises(RuntimeError, match="need two CUDA devices"):
        Engine(two_cpus, EngineConfig(**options))
    with pytest.raises(RuntimeError, match="need two CUDA devices"):
        setup_one_shot(jax.devices()[:2])


def test_an_engine_without_sp_mode_exchanges_nothing():
    """``--mode tp`` (or sp = 1) makes no SP step: the exchange is not set up or reported,
    whatever was asked."""
    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(2, 1, jax.devices()[:2]))
    heard = []
    engine = Engine(weights, EngineConfig(max_model_len=32, page_size=4, num_pages=16, max_num_seqs=2,
                                          max_num_batched_tokens=8, token_buckets=(8,), seq_buckets=(2,),
                                          attention="reference", mode="tp", all_to_all="one_shot"),
                    report=heard.append)
    assert engine.modes == ("tp",) and engine.all_to_all == "xla"
    assert "all_to_all_setup" not in engine.startup_seconds and not any("all-to-all" in line for line in heard)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_cli_option_reaches_the_engine_config(collective):
    import argparse

    from shiftjax.serving.engine.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flag = "--" + collective.replace("_", "-")
    assert engine_options(parser.parse_args([flag, "one_shot"]))[collective] == "one_shot"
    assert engine_options(parser.parse_args([]))[collective] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "nccl"])


def _fake_gpus(process_index=0, ordinals=(0, 1)):
    return [types.SimpleNamespace(platform="gpu", process_index=process_index, local_hardware_id=o) for o in ordinals]


def test_setup_refuses_gpus_of_another_process():
    with pytest.raises(RuntimeError, match="both GPUs in this process"):
        setup_one_shot(_fake_gpus(process_index=jax.process_index() + 1))


def test_a_step_on_gpus_not_set_up_is_refused():
    """(the kernel would write into buffers another pair of GPUs owns)"""
    with pytest.raises(ValueError, match="set up for GPUs none, not \\(2, 3\\)"):
        check_one_shot_ready(_fake_gpus(ordinals=(3, 2)))
    check_one_shot_ready(jax.devices()[:2])  # CPUs: lowered for inspection only, nothing runs


@pytest.mark.parametrize("collective, fallback", [("all_reduce", "psum"), ("all_to_all", "NCCL's all-to-all")])
@pytest.mark.parametrize("failure", [RuntimeError("no nvcc"), PermissionError("read-only cache"), OSError("bad .so")])
def test_auto_falls_back_to_xla_whatever_stops_the_kernel(monkeypatch, failure, collective, fallback):
    from shiftjax.serving.engine import builder as engine_module

    asked = []

    def failing(devices, **options):
        asked.append(options)
        raise failure
    monkeypatch.setattr(engine_module, "setup_one_shot", failing)
    mesh = types.SimpleNamespace(size=2, devices=np.array(_fake_gpus()))
    heard = []
    chosen = engine_module.choose_collective(collective, "auto", mesh, heard.append,
                                             lambda name: contextlib.nullcontext())
    assert chosen == "xla" and str(failure) in heard[0] and fallback in heard[0]
    with pytest.raises(type(failure)):
        engine_module.choose_collective(collective, "one_shot", mesh, heard.append,
                                        lambda name: contextlib.nullcontext())
    # auto takes the kernel only over NVLink, where it was measured; asked for by name, anywhere
    assert asked == [{"require_nvlink": True}, {"require_nvlink": False}]


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_store_keys_differ_by_collective(collective):
    from shiftjax.serving.engine.executable_store import step_key

    weights = shard_params(random_params(CONFIG, seed=1, scale=0.3), CONFIG, make_mesh(1, 2, jax.devices()[:2]))
    caches = _abstract_caches(weights)
    options = StepOptions(max_pages=4, attention="reference", layer_loop="scan", max_top_logprobs=0,
                          sample_in_step=False)
    bucket = dict(mode="tp", num_tokens=8, num_seqs=4)
    assert (step_key(weights, caches, options.replace(**{collective: "xla"}), **bucket)
            != step_key(weights, caches, options.replace(**{collective: "one_shot"}), **bucket))


def test_first_ordinal_is_the_first_mesh_devices_or_none_for_another_process():
    """(a multi-process mesh's other process sees the first device with no local ordinal;
    the step must still build there, with XLA's collectives)"""
    assert first_ordinal_of(make_mesh(2, 1, jax.devices()[1::-1])) == 1
    remote = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(local_hardware_id=None)]))
    assert first_ordinal_of(remote) is None
    with pytest.raises(ValueError, match="both GPUs in this process"):
        check_one_shot_ready(_fake_gpus(process_index=jax.process_index() + 1))
