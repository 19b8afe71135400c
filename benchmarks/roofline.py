"""Hardware limits measured in the same run as a benchmark, so ratios are honest.

Three ceilings, each the best of several tries (a single reading has varied from 2.94 to
3.84 TB/s for the copy on the same H200 model):

- ``copy_bandwidth``: a device-to-device copy, bytes read + bytes written per second;
- ``read_bandwidth``: a read-only stream (a reduction of a multi-GB bf16 array to a scalar
  or a short vector), bytes read per second. Decode reads its weights and writes almost
  nothing, so its floor is weight bytes over this rate;
- ``matmul_rate``: a large bf16 GEMM on random data, FLOP per second.

Each reading says which timer produced it: ``device span`` (first kernel start to last
kernel end from a profiler trace, ``device_time``; no host dispatch) where the trace has
device events, else ``host wall clock`` (``time_fn``; includes dispatch, which on the H200
host is 65-78 us a call, about 3% of a 4 GiB copy).

    python3 benchmarks/roofline.py [--json FILE]     # on the GPU
    python3 benchmarks/roofline.py --smoke           # tiny sizes, any machine
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

GiB = 1 << 30
DEVICE_SPAN = "device span"
HOST_WALL = "host wall clock"


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


def timed(fn, *args, iters: int = 10) -> tuple[float, str]:
    """(median seconds per call, which timer): the device span where a trace has one."""
    wall = time_fn(fn, *args, warmup=2, iters=iters)
    trace = device_time(fn, args, iters, quiet=True)
    if trace is not None:
        return trace["span"], DEVICE_SPAN
    return wall, HOST_WALL


def _best(label: str, make_fn, arrays, bytes_per_call: int, repeats: int) -> dict:
    """Best rate over ``repeats`` tries of each array; every try's rate is kept."""
    fn = jax.jit(make_fn)
    tries = []
    for _ in range(repeats):
        for array in arrays:
            seconds, timer = timed(fn, array)
            tries.append({"bytes": bytes_per_call(array), "seconds": seconds, "timer": timer,
                          "rate": bytes_per_call(array) / seconds})
    best = max(tries, key=lambda t: t["rate"])
    return {"what": label, "best": best["rate"], "timer": best["timer"],
            "tries": [round(t["rate"] / 1e12, 4) for t in tries]}


def _random_bf16(n_bytes: int, seed: int) -> jax.Array:
    """``n_bytes`` of random bf16 as ``[rows, 8192]``: a 64 MiB random block tiled (random
    data, not ones: a constant array can read faster; tiled, so no random-number kernel
    runs over 2**31 elements)."""
    rows = max(1, n_bytes // (2 * 8192))
    block = min(rows, 4096)
    base = jax.random.normal(jax.random.key(seed), (block, 8192), jnp.bfloat16)
    return jax.jit(lambda b: jnp.tile(b, (-(-rows // block), 1))[:rows])(base)


def copy_ceiling(n_bytes: int = 4 * GiB, repeats: int = 3, sizes: int = 2) -> dict:
    """Copy bandwidth (read + written bytes/s), best over ``repeats`` tries of each of
    ``sizes`` arrays (n_bytes, n_bytes / 2, ...)."""
    arrays = [_random_bf16(n_bytes >> i, i + 1) for i in range(sizes)]
    out = _best("copy a * 1.5 (bytes read + written / s)", lambda a: a * jnp.bfloat16(1.5), arrays,
                lambda a: 2 * a.nbytes, repeats)
    del arrays
    return out


def read_ceiling(n_bytes: int = 4 * GiB, repeats: int = 3) -> dict:
    """Read-only stream (bytes read / s): the best of two reductions of a bf16 array."""
    arrays = [_random_bf16(n_bytes // 2, 3), _random_bf16(n_bytes, 4)]
    whole = _best("sum to a scalar", lambda a: jnp.sum(a, dtype=jnp.float32), arrays,
                  lambda a: a.nbytes, repeats)
    rows = _best("row sums of [rows, 8192]",
                 lambda a: jnp.sum(a, axis=1, dtype=jnp.float32), arrays,
                 lambda a: a.nbytes, repeats)
    del arrays
    best = max((whole, rows), key=lambda r: r["best"])
    return {"what": f"read-only reduction, best of: {whole['what']}, {rows['what']}", "best": best["best"],
            "timer": best["timer"], "tries": {whole["what"]: whole["tries"], rows["what"]: rows["tries"]}}


def matmul_ceiling(n: int = 8192, repeats: int = 3, dtype=jnp.bfloat16) -> dict:
    """FLOP per second of an ``n x n x n`` matrix product on random data, best of repeats."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    fn = jax.jit(jnp.matmul)
    tries = [timed(fn, a, b) for _ in range(repeats)]
    seconds, timer = min(tries)
    return {"what": f"{n}^3 {jnp.dtype(dtype).name} matmul (FLOP/s)", "best": 2 * n**3 / seconds, "timer": timer,
            "tries": [round(2 * n**3 / s / 1e12, 1) for s, _ in tries]}


def ceilings(n_bytes: int = 4 * GiB, repeats: int = 3, matmul_n: int = 8192) -> dict:
    """All three ceilings, with every try and the timer that produced the best."""
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "copy": copy_ceiling(n_bytes, repeats), "read": read_ceiling(n_bytes, repeats),
            "matmul": matmul_ceiling(matmul_n, repeats)}


def describe(c: dict) -> str:
    """One line per ceiling, TB/s and TFLOP/s, with the tries and the timer."""
    return "\n".join([
        f"copy bandwidth (read+written): {c['copy']['best'] / 1e12:.3f} TB/s, best of {c['copy']['tries']} "
        f"[{c['copy']['timer']}]",
        f"read-only stream:              {c['read']['best'] / 1e12:.3f} TB/s, best of {c['read']['tries']} "
        f"[{c['read']['timer']}]",
        f"matmul:                        {c['matmul']['best'] / 1e12:.0f} TFLOP/s, best of {c['matmul']['tries']} "
        f"[{c['matmul']['timer']}]"])


def copy_bandwidth(n_bytes: int = 4 * GiB, repeats: int = 1) -> float:
    """Bytes moved (read + written) per second by one device-to-device copy of ``n_bytes``
    (best of ``repeats``); ``copy_ceiling`` is the robust reading."""
    return copy_ceiling(n_bytes, repeats, sizes=1)["best"]


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16) -> float:
    """FLOP per second of an ``n x n x n`` matrix product on random data."""
    return matmul_ceiling(n, 3, dtype)["best"]


def device_time(fn, args, iters, top=0, quiet=False):
    """GPU time of `iters` calls of fn(*args) from a profiler trace (CUPTI kernel records).

    Returns dict(span=median over calls of last-kernel-end minus first-kernel-start [s],
    ksum=median sum of kernel durations per call [s], kernels=kernels per call, top=[...])
    or None where the trace holds no device events (CPU, or no profiler); callers must then
    say that their number is host wall clock."""
    pd = profile(lambda: jax.block_until_ready(fn(*args)), iters, quiet=quiet, warmup=1)
    if pd is None:
        return None
    planes = [events for events in _device_events(pd).values() if events]
    ev = [e for events in planes for e in events]
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
        out["by_kind"] = kernel_breakdown(ev, iters * len(planes), top=0)["by_kind"]  # per device
    return out


def _device_events(pd, stats: bool = False) -> dict[str, list[tuple]]:
    """Kernel records of a profile, per device plane: (start ns, end ns, duration ns, name),
    and with ``stats`` a fifth item, the event's stats as a dict (XLA's ``hlo_op`` among
    them where it annotates the kernel); copies left out."""
    planes = {}
    for plane in pd.planes:
        if "GPU" not in plane.name and "device:" not in plane.name.lower():
            continue
        if "host" in plane.name.lower():
            continue
        lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
        events = planes.setdefault(plane.name, [])
        for line in lines:
            for e in line.events:
                if not e.name.startswith("Memcpy"):
                    record = (e.start_ns, e.start_ns + e.duration_ns, e.duration_ns, e.name)
                    events.append(record + (dict(e.stats),) if stats else record)
    return planes


def profile(fn, iters: int, *, quiet: bool = False, warmup: int = 0):
    """The profile (``ProfileData``) of ``iters`` calls of ``fn()``, after ``warmup``
    unprofiled ones; None where the profiler fails (it says why unless ``quiet``)."""
    try:
        from jax._src.lib import _profiler
        from jax.profiler import ProfileData
        for _ in range(warmup):
            fn()
        sess = _profiler.ProfilerSession()
        for _ in range(iters):
            fn()
        return ProfileData.from_serialized_xspace(sess.stop())
    except Exception as e:  # pragma: no cover
        if not quiet:
            print(f"  (profiler failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return None


def device_idle(fn, iters: int, gaps: int = 5, *, events: bool = False, top: int = 40) -> dict | None:
    """How much of the time each device sits idle while ``fn()`` is called ``iters`` times
    back to back (``fn`` syncs as it must: an engine step). Per device: the window from the
    first kernel's start to the last one's end, the time no kernel runs in it, as a
    fraction, the ``gaps`` longest idle gaps and the ``top`` kernels by time. With ``events``,
    also the kernel records themselves, stats included (``_device_events``). None without a
    device trace."""
    pd = profile(fn, iters)
    if pd is None:
        return None
    planes = _device_events(pd, stats=events)
    return {plane: {**_plane_idle(records, iters, gaps, top), **({"events": records} if events else {})}
            for plane, records in planes.items() if records} or None


def _plane_idle(events: list[tuple], iters: int, gaps: int = 5, top: int = 40) -> dict:
    """``device_idle``'s figures for one device's kernel records (sorted here)."""
    events.sort(key=lambda e: e[:2])
    busy, idle_gaps, end = 0, [], events[0][0]
    for start, stop, *_ in events:
        if start > end:
            idle_gaps.append(start - end)
        busy += max(stop - max(start, end), 0)
        end = max(end, stop)
    window = end - events[0][0]
    return {"window_ms": window * 1e-6, "idle_fraction": 1 - busy / window,
            "kernels": len(events), "longest_gaps_us": [g * 1e-3 for g in sorted(idle_gaps)[-gaps:][::-1]],
            **kernel_breakdown(events, iters, top)}


# first match wins: XLA's own all-reduce kernels are fusions named after the psum, shiftjax's
# one-shot all-reduce and exchange by their kernels' names, XLA's Triton GEMM fusions count as
# GEMMs, the Pallas attention by its name
KERNEL_KINDS = (("collective", ("nccl", "psum", "all_reduce", "all-reduce", "all_to_all", "all_gather", "one_shot_kernel",
                                 "exchange_kernel")), ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
                ("attention (Pallas)", ("ragged_paged_attention",)), ("other Triton", ("triton", "mosaic")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other (XLA fusions)")


def kernel_breakdown(events, steps: int, top: int = 40) -> dict:
    """Per step: kernel time and count by kind (``KERNEL_KINDS``) and the ``top`` kernels by
    time, from (start, end, duration ns, name) records of ``steps`` steps."""
    kinds, names = {}, {}
    for _, _, duration, name, *_ in events:
        for table, key in ((kinds, kernel_kind(name)), (names, name[:80])):
            entry = table.setdefault(key, [0, 0])
            entry[0] += duration
            entry[1] += 1
    per_step = lambda table: {k: {"ms": v[0] * 1e-6 / steps, "count": v[1] / steps} for k, v in table.items()}
    ranked = sorted(per_step(names).items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {"by_kind": per_step(kinds), "top_kernels": dict(ranked)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any machine): runs the code path only")
    parser.add_argument("--gib", type=float, default=4.0, help="largest array of the copy and read tests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the ceilings (every try included) to this file")
    args = parser.parse_args()
    if args.smoke:
        c = ceilings(n_bytes=8 << 20, repeats=1, matmul_n=128)
    else:
        c = ceilings(n_bytes=int(args.gib * GiB), repeats=args.repeats)
    print(f"device: {c['device']}, jax {c['jax']}")
    print(describe(c))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(c, f, indent=2)


if __name__ == "__main__":
    main()
