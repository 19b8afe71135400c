"""Hardware limits measured in the same run as a benchmark, so ratios are honest.

``copy_bandwidth`` times a device-to-device copy (bytes read + written per second);
``matmul_rate`` times a large bf16 GEMM on random data (FLOP per second).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def time_fn(fn, *args, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds per call of a jitted ``fn``, synchronising on its outputs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(n_bytes: int = 4 << 30) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    seconds = time_fn(copy, x)
    return 2 * n_bytes / seconds


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16) -> float:
    """FLOP per second of an ``n x n x n`` matrix product on random data."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    seconds = time_fn(jax.jit(jnp.matmul), a, b)
    return 2 * n**3 / seconds


if __name__ == "__main__":
    print(f"device: {jax.devices()[0].device_kind}")
    print(f"copy bandwidth: {copy_bandwidth() / 1e12:.2f} TB/s")
    print(f"bf16 matmul: {matmul_rate() / 1e12:.0f} TFLOP/s")
