"""SP mode's two ways to give attention every token of its head block (``make_step``'s
``qkv_exchange``): projecting local tokens then one all-to-all, or gathering the hidden
states then projecting with the device's own block. Same products, so the same bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stepping import run_scenario
from test_invariance import CONFIG

from shiftjax.kernels.collective_matmul import (
    all_gather_matmul,
    all_gather_matmul_reference,
    fused_kernel_fits,
)
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.steps import make_step


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=3)


@pytest.mark.parametrize("sp,tp", [(2, 2), (8, 1), (2, 4)])
def test_gathered_projection_writes_the_bytes_of_the_all_to_all_and_of_tp_mode(params, sp, tp):
    runs = {"tp": ["tp"], "sp": ["sp"], "alternate": ["tp", "sp"]}
    by_exchange = {exchange: run_scenario(params, CONFIG, sp, tp, runs, qkv_exchange=exchange)[0]
                   for exchange in ("all_to_all", "gather")}
    want_logits, want_caches = by_exchange["all_to_all"]["tp"]
    for exchange, results in by_exchange.items():
        for name, (logits, caches) in results.items():
            for kind in ("k", "v"):
                assert np.asarray(getattr(caches, kind)).tobytes() == np.asarray(getattr(want_caches, kind)).tobytes(), \
                    f"{exchange} {name}: {kind} cache differs from TP mode's"
            for step, (got, want) in enumerate(zip(logits, want_logits)):
                np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"{exchange} {name} {step}")
    # SP against SP: the layers' arithmetic is the same, so are the logits
    for got, want in zip(by_exchange["gather"]["sp"][0], by_exchange["all_to_all"]["sp"][0]):
        np.testing.assert_array_equal(got, want)


def test_gathered_projection_with_two_copies(params):
    """Two-copy storage sums SP mode's row GEMMs in one GEMM, so SP is not TP's bytes there
    (``layouts/blocks.py``); the gathered projection still changes nothing against the all-to-all."""
    got, want = (run_scenario(params, CONFIG, 2, 4, {"sp": ["sp"]}, storage="two_copies", qkv_exchange=exchange)[0]
                 ["sp"] for exchange in ("gather", "all_to_all"))
    for kind in ("k", "v"):
        assert np.asarray(getattr(got[1], kind)).tobytes() == np.asarray(getattr(want[1], kind)).tobytes()
    for got_logits, want_logits in zip(got[0], want[0]):
        np.testing.assert_array_equal(got_logits, want_logits)


def test_gather_matmul_entry_point():
    mesh = make_mesh(2, 1, jax.devices()[:2])
    x = jax.random.normal(jax.random.key(0), (2 * 8, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 2 * 4), jnp.float32)

    def run(implementation):
        return jax.jit(jax.shard_map(
            lambda x, w: all_gather_matmul(x, w, "sp", implementation=implementation), mesh=mesh,
            in_specs=(jax.P("sp"), jax.P(None, "sp")), out_specs=jax.P(None, "sp")))(x, w)

    np.testing.assert_array_equal(np.asarray(run("auto")), np.asarray(x @ w))  # the reference on the CPU
    with pytest.raises(ValueError, match="implementation='nope'"):
        run("nope")
    assert all_gather_matmul_reference.__name__.endswith("_reference")
    # why the fused kernel does not run here, by shape and place
    assert fused_kernel_fits(2048, 4096, 3072, jnp.bfloat16, 2) == "not a Hopper GPU"
    assert fused_kernel_fits(2048, 4096, 3072, jnp.bfloat16, 2, mesh_axes=2) == "a mesh of 2 axes"


def test_unknown_exchange_is_refused(params):
    from shiftjax.weights import shard_params

    weights = shard_params(params, CONFIG, make_mesh(2, 1, jax.devices()[:2]))
    with pytest.raises(ValueError, match="qkv_exchange must be one of"):
        make_step(weights, "sp", qkv_exchange="ring")
