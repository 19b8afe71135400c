"""The one-shot all-reduce kernel (kernels/one_shot_all_reduce.cu) on two GPUs, against
XLA's psum (NCCL) on the same GPUs: the same sums bit for bit, on both mesh orientations,
at a decode step's and a prefill step's sizes, call after call (the kernel alternates two
receive slots and counts its calls on the device). Run on 2x H200 by
``benchmarks/run_gpu_x2.sh`` (part ``tests``); skipped without two CUDA devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shiftjax.kernels.all_reduce import all_reduce, setup_one_shot
from shiftjax.layouts.mesh import SP, TP, make_mesh

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module", autouse=True)
def one_shot_ready():
    setup_one_shot(jax.devices()[:2])


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
