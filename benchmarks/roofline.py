"""Hardware limits measured in the same run as a benchmark, so ratios are honest.

``copy_bandwidth`` times a device-to-device copy (bytes read + written per second);
``matmul_rate`` times a large bf16 GEMM on random data (FLOP per second); ``time_fn`` is host
wall clock per call, ``device_time`` the GPU time from a profiler trace (no dispatch).
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


def device_time(fn, args, iters, top=0):
    """GPU time of `iters` calls of fn(*args) from a profiler trace (CUPTI kernel records).

    Returns dict(span=median over calls of last-kernel-end minus first-kernel-start [s],
    ksum=median sum of kernel durations per call [s], kernels=kernels per call, top=[...])
    or None where the trace holds no device events (CPU, or no profiler)."""
    try:
        from jax._src.lib import _profiler
        from jax.profiler import ProfileData
        jax.block_until_ready(fn(*args))
        sess = _profiler.ProfilerSession()
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
        pd = ProfileData.from_serialized_xspace(sess.stop())
    except Exception as e:  # pragma: no cover
        print(f"  (profiler failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return None
    ev = []
    for plane in pd.planes:
        if "GPU" not in plane.name and "device:" not in plane.name.lower():
            continue
        if "host" in plane.name.lower():
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
        for line in lines:
            for e in line.events:
                if e.name.startswith("Memcpy"):
                    continue
                ev.append((e.start_ns, e.start_ns + e.duration_ns, e.duration_ns, e.name))
    if len(ev) < iters:
        return None
    ev.sort()
    # the iters-1 largest idle gaps of the device separate the calls
    gaps, maxend = [], ev[0][1]
    for i in range(1, len(ev)):
        gaps.append((ev[i][0] - maxend, i))
        maxend = max(maxend, ev[i][1])
    cuts = sorted(i for _, i in sorted(gaps)[len(gaps) - (iters - 1):]) if iters > 1 else []
    runs, start = [], 0
    for c in cuts + [len(ev)]:
        runs.append(ev[start:c])
        start = c
    spans = sorted((max(x[1] for x in r) - r[0][0]) * 1e-9 for r in runs if r)
    ksums = sorted(sum(x[2] for x in r) * 1e-9 for r in runs if r)
    out = dict(span=spans[len(spans) // 2], ksum=ksums[len(ksums) // 2], kernels=len(ev) / iters)
    if top:
        agg = {}
        for x in ev:
            a = agg.setdefault(x[3][:70], [0, 0])
            a[0] += x[2]
            a[1] += 1
        out["top"] = sorted(((v[0] * 1e-9 / iters, v[1] / iters, k) for k, v in agg.items()), reverse=True)[:top]
    return out


if __name__ == "__main__":
    print(f"device: {jax.devices()[0].device_kind}")
    print(f"copy bandwidth: {copy_bandwidth() / 1e12:.2f} TB/s")
    print(f"bf16 matmul: {matmul_rate() / 1e12:.0f} TFLOP/s")
