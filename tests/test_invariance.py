"""One KV cache for both modes: byte-identical pages, the same arrays and specs, donated in place."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import stepping
from stepping import run_scenario

from shiftjax.config import ModelConfig
from shiftjax.params import random_params
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step, params_for

CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=120, hidden_size=64, intermediate_size=100, num_layers=2,
    num_heads=9, num_kv_heads=3, head_dim=16, qkv_bias=True, max_position_embeddings=64)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=3)


@pytest.mark.parametrize("sp,tp", [(2, 2), (8, 1), (2, 4)])
def test_tp_sp_and_alternate_leave_identical_pages(params, sp, tp):
    results, _ = run_scenario(params, CONFIG, sp, tp,
                              {"tp": ["tp"], "sp": ["sp"], "alternate": ["tp", "sp"], "alternate_sp_first": ["sp", "tp"]})
    reference_logits, reference_caches = results["tp"]
    for name, (logits, caches) in results.items():
        assert caches.k.sharding.spec == reference_caches.k.sharding.spec
        for kind in ("k", "v"):
            got = np.asarray(getattr(caches, kind))
            want = np.asarray(getattr(reference_caches, kind))
            assert got.tobytes() == want.tobytes(), f"{name}: {kind} cache differs from TP mode's"
        for step, (got, want) in enumerate(zip(logits, reference_logits)):
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"{name} step {step}")
    # The scenario wrote real data: pages of both sequences are non-zero.
    k = np.asarray(reference_caches.k)
    assert np.abs(k[:, :, stepping.PAGES[0][0]]).sum() > 0 and np.abs(k[:, :, stepping.PAGES[1][0]]).sum() > 0


def test_unrolled_layers_equal_the_scan(params):
    scanned, _ = run_scenario(params, CONFIG, 2, 2, {"alternate": ["tp", "sp"]})
    unrolled, _ = run_scenario(params, CONFIG, 2, 2, {"alternate": ["tp", "sp"]}, layer_loop="unrolled")
    for (a, b) in zip(scanned["alternate"][0], unrolled["alternate"][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    np.testing.assert_allclose(np.asarray(scanned["alternate"][1].k), np.asarray(unrolled["alternate"][1].k),
                               rtol=1e-5, atol=1e-6)


def _cache_param_indices(hlo: str, local_cache_shape) -> list[int]:
    header = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
    shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", header)
    target = ",".join(map(str, local_cache_shape))
    return [i for i, s in enumerate(shapes) if s == target]


def _assert_caches_aliased(hlo: str, local_cache_shape, *context) -> None:
    """Both cache parameters of a compiled step are aliased to its outputs (donated)."""
    aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo).group(1)
    aliased_params = {int(p) for p in re.findall(r"\((\d+), \{\}, may-alias\)", aliases)}
    cache_params = _cache_param_indices(hlo, local_cache_shape)
    assert len(cache_params) == 2 and set(cache_params) <= aliased_params, (*context, aliases)


def test_executables_share_the_cache_and_donate_it(params):
    results, weights = run_scenario(params, CONFIG, 2, 2, {"tp": ["tp"]})
    caches = results["tp"][1]
    batch = jax.tree.map(jnp.asarray, stepping.build_batch(stepping.scenario(CONFIG.vocab_size)[0], [0, 0]))
    compiled = {mode: make_step(weights, mode, StepOptions(attention="reference")).lower(
        params_for(weights, mode), caches, batch).compile() for mode in ("tp", "sp")}

    # Same cache shardings in and out, in both executables. (Rebuilding the pytrees with
    # shardings as leaves is not what the shape annotations describe: checks off here.)
    shardings = {}
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        io = {mode: (exe.input_shardings, exe.output_shardings) for mode, exe in compiled.items()}
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    for mode, (inputs, outputs) in io.items():
        (_, cache_in, _), _ = inputs
        _, cache_out = outputs
        assert cache_in.k.spec == cache_out.k.spec == caches.k.sharding.spec
        shardings[mode] = cache_in.k
    assert shardings["tp"].is_equivalent_to(shardings["sp"], caches.k.ndim)

    local_shape = caches.k.addressable_shards[0].data.shape
    layer_slice_shapes = {local_shape, local_shape[1:], (1, *local_shape[1:])}
    for mode, exe in compiled.items():
        hlo = exe.as_text()
        # The donated caches are aliased to the step's outputs...
        _assert_caches_aliased(hlo, local_shape, mode)
        # ...and no instruction copies or dynamically slices a cache or a layer of it.
        for match in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} (copy|dynamic-slice|slice)\(", hlo):
            shape = tuple(int(d) for d in match.group(1).split(",") if d)
            assert shape not in layer_slice_shapes, f"{mode}: {match.group(0)}"
    # Running them really donates: the input buffers are consumed.
    out, new_caches = compiled["sp"](params_for(weights, "sp"), caches, batch)
    assert caches.k.is_deleted() and not new_caches.k.is_deleted()


def test_unrolled_layers_lower_one_layer_and_update_the_cache_in_place(params):
    """The unrolled loop calls one jitted layer: its Pallas kernels are lowered once, not per
    layer (lowering was most of an 8B step's start-up), and after XLA inlines the calls the
    caches are still updated in place."""
    config = dataclasses.replace(CONFIG, num_layers=3)
    results, weights = run_scenario(random_params(config, seed=3), config, 2, 2, {"tp": ["tp"]})
    caches = results["tp"][1]
    batch = jax.tree.map(jnp.asarray, stepping.build_batch(stepping.scenario(config.vocab_size)[0], [0, 0]))
    args = (params_for(weights, "tp"), caches, batch)

    # Lowered for CUDA (no GPU needed): one layer function, a call per layer, each Pallas
    # kernel (the cache write, prefill and decode attention, the merge of the decode splits) once.
    cuda = make_step(weights, "tp", StepOptions(attention="pallas", layer_loop="unrolled")).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"func\.func private @(layer\w*)", cuda) == ["layer"]
    assert len(re.findall(r"call @layer\(", cuda)) == config.num_layers
    assert cuda.count("custom_call @__gpu$xla.gpu.triton") == 4

    hlo = make_step(weights, "tp", StepOptions(attention="reference", layer_loop="unrolled")).lower(*args).compile().as_text()
    local_shape = caches.k.addressable_shards[0].data.shape
    _assert_caches_aliased(hlo, local_shape)
    assert not re.search(r"= [a-z0-9]+\[%s\]\{[^}]*\} copy\(" % ",".join(map(str, local_shape)), hlo)
