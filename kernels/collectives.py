"""The steps' collectives: XLA's (NCCL), or on two GPUs one-shot kernels of our own.

TP mode sums partials (``all_reduce``); SP mode exchanges head blocks for tokens and back
(``all_to_all``). Each takes an implementation:

``xla`` (the reference): ``psum`` over the named mesh axes in order; ``lax.all_to_all``.

``one_shot`` (``one_shot_collectives.cu``): each GPU writes what the other needs (its
partial sums; the half of its block the other owns) straight into a buffer on the other
over NVLink, raises a flag there, waits for the other's, and adds (the all-reduce) or
copies into place (the all-to-all). They are XLA FFI custom calls that XLA records into its
CUDA graphs, where each NCCL collective splits a step into one graph per stretch between
collectives (~66 per GPU in a TP decode step of Llama-3.1-8B; benchmarks/README.md, "One-shot
all-reduce"). They apply where the collective spans exactly the
mesh's two GPUs, in this process, and the message fits the receive slot; anything else
takes XLA's. The sums are bf16(float(a) + float(b)), the same on both GPUs and, as
measured, NCCL's bit for bit; the exchange moves bytes. If one GPU's step fails, the
other's kernel traps after 20 s: that GPU's CUDA context is then unusable and the process
must restart (NCCL would hang instead).

The library is compiled with ``nvcc`` on first use (cached by the source's hash) and set up
once per process (``setup_one_shot``: buffers on both GPUs, peer access); XLA's FFI
registry is process-wide, so the loaded library is kept per process too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
from jax import lax
from jaxtyping import Array, Float

ALL_REDUCES = ("xla", "one_shot")
ALL_TO_ALLS = ("xla", "one_shot")
TARGET = "shiftjax_one_shot_all_reduce"
EXCHANGE_TARGET = "shiftjax_one_shot_all_to_all"
SOURCE = Path(__file__).with_name("one_shot_collectives.cu")
DEFAULT_CAPACITY_BYTES = 32 * 2**20  # per receive slot: a 4096-token step of hidden 4096 in bf16
_NVCC_CANDIDATES = ("nvcc", "/usr/local/cuda/bin/nvcc")

# Process-wide, as XLA's FFI registry and the kernel's buffers are: the libraries loaded.
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}
_set_up: list[tuple[int, int]] = []  # the CUDA ordinals the library's buffers are on (one pair)


def psum_reference(x: Float[Array, "*shape"], axes: tuple[str, ...]) -> Float[Array, "*shape"]:
    """``x`` summed over ``axes``, one ``psum`` per axis in the order given (TP mode sums
    over ``sp`` first, so it adds what SP mode adds locally)."""
    for axis in axes:
        x = lax.psum(x, axis)
    return x


def all_reduce(x: Float[Array, "*shape"], axes: tuple[str, ...], implementation: str = "xla") -> Float[Array, "*shape"]:
    """``x`` summed over the mesh ``axes`` (inside ``shard_map``) by ``implementation``.
    ``one_shot`` applies where the sum spans the mesh's two devices, ``x`` is bf16 in whole
    16-byte words and fits ``DEFAULT_CAPACITY_BYTES`` (the receive slot ``setup_one_shot``
    makes); elsewhere, and for ``xla``, ``psum_reference``."""
    if implementation not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {implementation!r}")
    group = int(np.prod([lax.axis_size(axis) for axis in axes]))
    # the kernel's group is the two GPUs set up: the whole mesh, not two of a larger one
    mesh_size = jax.sharding.get_abstract_mesh().size
    fits = x.dtype == jax.numpy.bfloat16 and x.size % 8 == 0 and 2 * x.size <= DEFAULT_CAPACITY_BYTES
    if implementation == "xla" or not group == mesh_size == 2 or not fits:
        return psum_reference(x, axes)
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def all_to_all(x: Float[Array, "*shape"], axis: str, split_axis: int, implementation: str = "xla",
               first_ordinal: int | None = None) -> Float[Array, "*out_shape"]:
    """``lax.all_to_all(x, axis, split_axis, 0, tiled=True)`` (inside ``shard_map``) by
    ``implementation``. ``one_shot`` applies where ``axis`` spans the mesh's two devices,
    ``x`` is bf16, each half's rows are whole 16-byte words and a half fits
    ``DEFAULT_CAPACITY_BYTES``; elsewhere, and for ``xla``, XLA's all-to-all (NCCL).
    ``first_ordinal``: the CUDA ordinal of the mesh's first device (the kernel learns its
    position on ``axis`` from it; ``steps.make_step`` passes it)."""
    if implementation not in ALL_TO_ALLS:
        raise ValueError(f"all_to_all must be one of {ALL_TO_ALLS}, got {implementation!r}")
    split_axis %= x.ndim
    outer, inner = _halves(x.shape, split_axis)
    mesh_size = jax.sharding.get_abstract_mesh().size
    fits = (x.dtype == jax.numpy.bfloat16 and x.size > 0 and x.shape[split_axis] % 2 == 0 and inner % 8 == 0
            and outer * inner * x.dtype.itemsize <= DEFAULT_CAPACITY_BYTES)
    if implementation == "xla" or not lax.axis_size(axis) == mesh_size == 2 or not fits:
        return lax.all_to_all(x, axis, split_axis, 0, tiled=True)
    if first_ordinal is None:
        raise ValueError("all_to_all one_shot needs first_ordinal, the CUDA ordinal of the mesh's first device")
    return exchange_call(x, split_axis, EXCHANGE_TARGET, first_ordinal)


def exchange_call(x, split_axis: int, target: str, first_ordinal: int):
    """The custom call ``target`` (the library's all-to-all, or a benchmark's build of it)
    for ``all_to_all``, which checks that it applies."""
    shape = x.shape
    outer, inner = _halves(shape, split_axis)
    out_shape = (2 * shape[0], *shape[1:]) if split_axis else shape
    out_shape = tuple(n // 2 if i == split_axis and split_axis else n for i, n in enumerate(out_shape))
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((2 * outer * inner,), x.dtype))(
        x.reshape(-1), outer=np.int64(outer), inner=np.int64(inner), first_ordinal=np.int64(first_ordinal))
    return out.reshape(out_shape)


def _halves(shape: tuple[int, ...], split_axis: int) -> tuple[int, int]:
    """``shape`` as the kernel's ``[outer][2][inner]``: rows before ``split_axis``, and the
    elements of each half's row."""
    return int(np.prod(shape[:split_axis])), int(np.prod(shape[split_axis:])) // 2


def first_ordinal_of(mesh) -> int | None:
    """The ``first_ordinal`` of ``all_to_all`` for ``mesh``: None where the first device
    belongs to another process (a multi-process mesh, where the kernels do not apply)."""
    ordinal = mesh.devices.flat[0].local_hardware_id  # None for another process's device
    return None if ordinal is None else int(ordinal)


def setup_one_shot(devices, *, require_nvlink: bool = False, cache_dir: str | None = None) -> None:
    """Compiles (once, cached), loads and registers the kernels, and sets up their buffers on
    the two CUDA ``devices`` (the mesh's, in any order; once per process: a second call for
    the same GPUs does nothing). Call before a step with a ``one_shot`` collective is made
    (``steps.make_step`` checks). ``require_nvlink``: refuse GPUs whose peer access has
    no native atomics (PCIe), where the kernel was never measured. Raises RuntimeError with
    the reason where it cannot (no nvcc, not two GPUs of this process, no P2P, already set up
    for other GPUs)."""
    devices = list(devices)
    if len(devices) != 2 or any(d.platform != "gpu" for d in devices):
        raise RuntimeError(f"the one-shot collectives need two CUDA devices, got {devices}")
    if any(d.process_index != jax.process_index() for d in devices):
        raise RuntimeError("the one-shot collectives need both GPUs in this process (a multi-process mesh "
                           "takes XLA's)")
    ordinals = tuple(sorted(int(d.local_hardware_id) for d in devices))
    with _lock:
        if ordinals in _set_up:  # both collectives ask: the second finds it done (no nvcc call)
            return
        library = _load(devices[0], cache_dir)
        if not library.shiftjax_all_reduce_setup(ordinals[0], ordinals[1], DEFAULT_CAPACITY_BYTES,
                                                 int(require_nvlink)):
            raise RuntimeError("one-shot collectives' set-up failed: "
                               + library.shiftjax_all_reduce_error().decode(errors="replace"))
        _set_up.append(ordinals)


def check_one_shot_ready(devices) -> None:
    """Raises ValueError unless ``setup_one_shot`` has run for exactly these GPUs: a step
    whose kernel ran on other GPUs would write into buffers another mesh owns."""
    devices = list(devices)
    if any(d.platform != "gpu" for d in devices):
        return  # lowered for inspection only: no GPU can run it
    if any(d.process_index != jax.process_index() for d in devices):
        raise ValueError("one_shot collectives need both GPUs in this process (a multi-process mesh takes XLA's)")
    ordinals = tuple(sorted(int(d.local_hardware_id) for d in devices))
    if ordinals not in _set_up:
        raise ValueError(f"one_shot collectives: set up for GPUs {_set_up or 'none'}, not {ordinals}; "
                         f"call kernels.collectives.setup_one_shot(mesh devices) first")


def _load(device, cache_dir: str | None, defines: tuple[str, ...] = (), suffix: str = "") -> ctypes.CDLL:
    """The library built for ``device`` (with ``-D`` ``defines``), loaded once, its kernels
    registered as ``TARGET + suffix`` and ``EXCHANGE_TARGET + suffix`` (a benchmark loads
    builds side by side under their own suffixes; each has buffers of its own to set up)."""
    path = _compiled(device, cache_dir, defines)
    if str(path) in _loaded:
        return _loaded[str(path)]
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:  # e.g. built against a CUDA runtime this machine lacks
        raise RuntimeError(f"could not load {path}: {error}") from error
    library.shiftjax_all_reduce_setup.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int)
    library.shiftjax_all_reduce_setup.restype = ctypes.c_int
    library.shiftjax_all_reduce_error.restype = ctypes.c_char_p
    jax.ffi.register_ffi_target(TARGET + suffix, jax.ffi.pycapsule(library.ShiftjaxOneShotAllReduce), platform="CUDA")
    jax.ffi.register_ffi_target(EXCHANGE_TARGET + suffix, jax.ffi.pycapsule(library.ShiftjaxOneShotAllToAll),
                                platform="CUDA")
    _loaded[str(path)] = library
    return library


def _default_cache_dir() -> Path:
    """``<repo>/.cache/shiftjax/kernels`` from a source tree, else under the current
    directory: beside the compilation cache (``serving.engine_args``)."""
    repo = Path(__file__).resolve().parents[1]
    return (repo if (repo / "pyproject.toml").is_file() else Path.cwd()) / ".cache" / "shiftjax" / "kernels"


def _compiled(device, cache_dir: str | None, defines: tuple[str, ...] = ()) -> Path:
    """The kernel's shared library for ``device``'s architecture, compiled if not cached
    (``defines``: ``-D`` macros, for benchmarks that build variants)."""
    nvcc = next((found for name in _NVCC_CANDIDATES if (found := shutil.which(name))), None)
    if nvcc is None:
        raise RuntimeError("the one-shot collectives are compiled on first use and need nvcc "
                           "(on PATH or in /usr/local/cuda/bin)")
    major, minor = str(getattr(device, "compute_capability", "9.0")).split(".")[:2]
    arch = f"sm_{major}{minor}"
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"{nvcc} --version failed: {error}") from error
    flags = ["-O3", "-std=c++17", "--shared", "-Xcompiler", "-fPIC", f"-arch={arch}", f"-I{jax.ffi.include_dir()}",
             *(f"-D{define}" for define in defines)]
    # the FFI headers come with jaxlib: a new jaxlib builds anew
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), " ".join(flags).encode(),
                                      jax.__version__.encode(), jax.lib.__version__.encode()])).hexdigest()[:16]
    folder = Path(cache_dir or _default_cache_dir())
    path = folder / f"one_shot_all_reduce_{arch}_{key}.so"
    if path.exists():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RuntimeError(f"cannot create the kernel cache {folder}: {error}") from error
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / path.name
        command = [nvcc, *flags, str(SOURCE), "-o", str(built)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"nvcc took over 600 s: {' '.join(command)}") from error
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(command)}):\n{result.stderr[-3000:]}")
        os.replace(built, path)  # atomic: a concurrent process sees all of it or none
    return path
