"""The one-shot kernels (kernels/one_shot_collectives.cu) on two GPUs, against XLA's
collectives (NCCL) on the same GPUs: the all-reduce's sums and the all-to-all's blocks the
same bit for bit, on both mesh orientations, at a decode step's and a prefill step's sizes,
call after call (the kernels alternate two receive slots and count their calls on the
device, one count for both). Run with ``-m gpu`` on two GPUs (measured on 2x H200);
skipped without two CUDA devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shiftjax.kernels.collectives import (
    EXCHANGE_TARGET,
    TARGET,
    all_reduce,
    all_to_all,
    first_ordinal_of,
    setup_one_shot,
)
from shiftjax.layouts.mesh import SP, TP, make_mesh

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module", autouse=True)
def one_shot_ready():
    setup_one_shot(jax.devices()[:2], require_nvlink=True)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
@pytest.mark.parametrize("rows", [1, 8, 64, 1024])
def test_one_shot_equals_psum(shape, rows):
    mesh = make_mesh(*shape, jax.devices()[:2])
    spec = P((SP, TP))

    def summed(implementation):
        return jax.jit(jax.shard_map(lambda x: all_reduce(x, (SP, TP), implementation), mesh=mesh,
                                     in_specs=spec, out_specs=spec, check_vma=False))
    one_shot, xla = summed("one_shot"), summed("xla")
    for seed in range(5):  # successive calls: both slots, the call counter advancing
        x = jax.device_put(jax.random.normal(jax.random.key(seed), (2 * rows, 4096), jnp.bfloat16),
                           NamedSharding(mesh, spec))
        got, want = np.asarray(one_shot(x)), np.asarray(xla(x))
        assert (got.view(np.uint16) == want.view(np.uint16)).all()
        assert (got[:rows].view(np.uint16) == got[rows:].view(np.uint16)).all()  # both GPUs hold it


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_one_shot_inside_a_cuda_graph_equals_psum(rows):
    """Eight products and sums in one jit, which XLA records as one CUDA graph and replays:
    twenty calls with fresh inputs give psum's sums bit for bit (the kernel's call number
    and slots advance on the device while the graph's arguments stay the same)."""
    mesh = make_mesh(1, 2, jax.devices()[:2])
    spec = P((SP, TP))
    w = jax.device_put(jax.random.normal(jax.random.key(99), (512, 512), jnp.bfloat16) * (0.5 / 512 ** 0.5),
                       NamedSharding(mesh, P()))

    def chain(implementation):
        def body(x, w):
            for _ in range(8):
                x = all_reduce(x @ w, (SP, TP), implementation)
            return x
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False))
    one_shot, xla = chain("one_shot"), chain("xla")
    for seed in range(20):
        x = jax.device_put(jax.random.normal(jax.random.key(seed), (2 * rows, 512), jnp.bfloat16),
                           NamedSharding(mesh, spec))
        got, want = np.asarray(one_shot(x, w)), np.asarray(xla(x, w))
        assert (got.view(np.uint16) == want.view(np.uint16)).all(), seed


@pytest.mark.parametrize("shape, order", [((2, 1), 1), ((1, 2), 1), ((2, 1), -1)])
@pytest.mark.parametrize("split_axis, dims", [(1, (1, 2, 6144)), (1, (2048, 2, 3072)), (0, (2, 8, 4096)),
                                              (0, (2, 2048, 4096)), (2, (3, 4, 16)), (1, (512, 2, 1024))])
def test_one_shot_all_to_all_equals_xla(shape, order, split_axis, dims):
    """SP's two exchanges a layer (split the q|k|v blocks, then the tokens), at decode and
    prefill sizes, and a split of the last axis; over the mesh axis that has the two GPUs, in either
    order of the GPUs."""
    mesh = make_mesh(*shape, jax.devices()[:2][::order])
    axis = SP if shape[0] == 2 else TP
    spec = P(axis)

    def exchanged(implementation):
        return jax.jit(jax.shard_map(lambda x: all_to_all(x, axis, split_axis, implementation, first_ordinal_of(mesh)),
                                     mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    one_shot, xla = exchanged("one_shot"), exchanged("xla")
    assert EXCHANGE_TARGET in one_shot.lower(jnp.zeros((2 * dims[0], *dims[1:]), jnp.bfloat16)).as_text()
    for seed in range(4):
        x = jax.device_put(jax.random.normal(jax.random.key(seed), (2 * dims[0], *dims[1:]), jnp.bfloat16),
                           NamedSharding(mesh, spec))
        got, want = np.asarray(one_shot(x)), np.asarray(xla(x))
        assert got.shape == want.shape
        assert (got.view(np.uint16) == want.view(np.uint16)).all(), seed


@pytest.mark.parametrize("order", [1, -1])
@pytest.mark.parametrize("rows", [8, 512, 4096])
def test_one_shot_all_to_all_and_all_reduce_inside_a_cuda_graph(rows, order):
    """Exchanges and sums interleaved in one jit (each protocol counts its calls on the device),
    replayed twenty times: XLA's results bit for bit. Between them only exact operations (a
    roll, halving), so that no GEMM XLA may tune differently in the two programs rounds
    otherwise. Both GPU orders: the exchange keeps the mesh position's half but counts its
    calls, as the all-reduce does, on its own GPU's buffers."""
    mesh = make_mesh(2, 1, jax.devices()[:2][::order])
    spec = P(SP)

    def chain(implementation):
        def body(x):
            for _ in range(4):
                y = all_to_all(jnp.roll(x, 1, axis=1).reshape(rows, 2, 128), SP, 1, implementation,
                               first_ordinal_of(mesh))  # [2 rows, 1, 128]
                y = all_to_all(y.reshape(2, rows, 128), SP, 0, implementation, first_ordinal_of(mesh))
                y = y.reshape(rows, 256)
                x = all_reduce(y, (SP,), implementation) * 0.5
            return x
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    one_shot, xla = chain("one_shot"), chain("xla")
    text = one_shot.lower(jnp.zeros((2 * rows, 256), jnp.bfloat16)).as_text()
    assert text.count(f"custom_call @{EXCHANGE_TARGET}") == 8 and text.count(f"custom_call @{TARGET}") == 4
    for seed in range(20):
        x = jax.device_put(jax.random.normal(jax.random.key(seed), (2 * rows, 256), jnp.bfloat16),
                           NamedSharding(mesh, spec))
        got, want = np.asarray(one_shot(x)), np.asarray(xla(x))
        assert (got.view(np.uint16) == want.view(np.uint16)).all(), seed


def test_a_second_setup_for_the_same_gpus_is_a_no_op_and_other_gpus_are_refused():
    setup_one_shot(jax.devices()[:2], require_nvlink=True)
    setup_one_shot(jax.devices()[1::-1])  # same pair, other order
    if jax.device_count() > 2:
        with pytest.raises(RuntimeError, match="already set up"):
            setup_one_shot(jax.devices()[1:3])
