"""Compiled steps (and samplers) kept on disk, so that a warm start neither traces nor lowers them.

JAX's persistent compilation cache is keyed by the lowered program, so even a start whose
every executable is cached still traces and lowers each step first: about 7 s per
executable for the unrolled 32-layer Llama-3.1-8B step on the H200 host before each layer
was lowered once (benchmarks/README.md, "Executable store"; since then ~0.2 s on a 2-core CPU,
"CPU"), where loading the cached binary takes under 1 s. This store
is keyed instead by everything the lowering is a function of, so a hit skips tracing,
lowering and compiling:

- the source of the package (every ``.py`` file of shiftjax and its subpackages: the
  model, the step, the kernels, the layouts);
- the versions of jax and jaxlib, the backend's platform version, JAX's configuration
  values and ``XLA_FLAGS``;
- the devices (kind, id, order) and the mesh's axes;
- the step's own parameters (mode, buckets, page-table width, attention, layer loop,
  top-logprob width, XLA compile options such as the GEMM backend) and the model (config,
  head layout, local dims, weight storage);
- the abstract inputs: every parameter and cache array's shape, dtype and sharding.

A change to any of them is a miss, and the step is lowered and compiled as usual (through
the persistent compilation cache). An entry that cannot be read or loaded, or whose
header names another key or whose payload digest differs, is a miss too, reported, and
replaced. Entries are written atomically (a temporary file of this process, then rename).

Only executables XLA has just compiled are stored (compile_all): one that JAX loaded
from its own persistent cache, serialized again, loads but fails when run on the CPU
(jaxlib 0.10.2); and the engine runs every stored step once at start, compiling again one
that fails. The store is off unless asked for (``--executable-store``), for one
process only (a multi-process mesh would need one writer and agreed hits), and a stored
file is code that runs: keep the directory private. The KV cache's page count is part of
the inputs, so give ``--num-pages`` for a key that holds across starts (a pool sized from
free memory may differ by a page; the size of the steps' temporaries that sizing needs is
kept here too, :meth:`ExecutableStore.save_number`). Old entries are not pruned: a new
source tree writes a new set.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import json
import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

from shiftjax.cache import KVCache
from shiftjax.step_options import StepOptions
from shiftjax.steps import params_for
from shiftjax.weights import ModelWeights

FORMAT_VERSION = 1
PACKAGES = ("shiftjax", "shiftjax.kernels", "shiftjax.layouts", "shiftjax.serving", "shiftjax.checkpoints")


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 over the path and bytes of every ``.py`` file of the package, once per process."""
    digest = hashlib.sha256()
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{name}:{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _abstract(tree) -> list:
    """Shape, dtype and sharding of every array of ``tree``, with the tree's structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return [str(treedef), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]]


@functools.cache
def _plugin_versions() -> list[tuple[str, str]]:
    """The installed JAX backend plugins (the CUDA compiler ships in them, not in jaxlib)."""
    return sorted((d.metadata["Name"], d.version) for d in importlib.metadata.distributions()
                  if (d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda", "jax-rocm", "libtpu")))


def environment_fingerprint(devices: list) -> dict:
    """What the compiled program depends on beyond the step itself."""
    backend = devices[0].client
    return {
        "format": FORMAT_VERSION,
        "source": source_fingerprint(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "plugins": _plugin_versions(),
        "platform": backend.platform, "platform_version": backend.platform_version,
        "devices": [(d.platform, d.device_kind, d.id, d.process_index, getattr(d, "compute_capability", None))
                    for d in devices],
        "jax_config": sorted((k, repr(v)) for k, v in jax.config.values.items()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def step_key(weights: ModelWeights, caches: KVCache, options: StepOptions, *, mode: str, num_tokens: int,
             num_seqs: int, result_rows: int | None = None, compiler_options: dict | None = None) -> str:
    """The store key of one compiled step: a SHA-256 over its environment, model, inputs,
    options and XLA's compile options (see the module docstring)."""
    return _key(weights, inputs=[_abstract(params_for(weights, mode)), _abstract(caches)],
                step={"mode": mode, "num_tokens": num_tokens, "num_seqs": num_seqs, "result_rows": result_rows,
                      "compiler_options": compiler_options, **options.key()})


def sampler_key(weights: ModelWeights, **sampler_options) -> str:
    """The store key of one compiled sampler (``sampler_executables.py``): its environment, model and
    ``sampler_options``, every argument it is made and lowered with. Named apart from the
    steps' keys, so that the store's files say which is which."""
    return "sampler-" + _key(weights, sampler=sampler_options)


def temporaries_key(weights: ModelWeights, caches: KVCache, options: StepOptions, *, modes, num_tokens: int,
                    num_seqs: int, result_rows: int, compiler_options: dict | None) -> str:
    """The store key of the steps' temporary buffer size (``compile.temporary_bytes``,
    which compiles the largest steps to learn it): a function of the same things as those
    steps' keys, ``caches`` the abstract ones it lowers against."""
    return "temporaries-" + _key(weights, inputs=[[_abstract(params_for(weights, mode)) for mode in modes],
                                                  _abstract(caches)],
                                 step={"modes": list(modes), "num_tokens": num_tokens, "num_seqs": num_seqs,
                                       "result_rows": result_rows, "compiler_options": compiler_options,
                                       **options.key()})


def _key(weights: ModelWeights, **program) -> str:
    mesh = weights.mesh
    description = {
        "environment": environment_fingerprint(list(mesh.devices.flat)),
        "mesh": [list(mesh.axis_names), list(mesh.devices.shape)],
        "model": [repr(weights.config), repr(weights.layout), repr(weights.dims), weights.storage, weights.quantization],
        **program,
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=repr).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class ExecutableStore:
    """Serialized compiled steps in ``directory``, one file per key: a header line (format,
    key, SHA-256 of the payload) and the pickled ``serialize_executable`` triple."""

    directory: Path

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.executable"

    def load(self, key: str, devices: list, report: Callable[[str], None] | None = None):
        """The compiled step stored under ``key``, loaded onto ``devices`` (the mesh's, in
        order), or None: not stored, or stored but unusable (``report`` says why)."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            header, payload = path.read_bytes().split(b"\n", 1)
            fields = json.loads(header)
            if fields != {"format": FORMAT_VERSION, "key": key, "sha256": hashlib.sha256(payload).hexdigest()}:
                raise ValueError(f"header {fields} does not match this key and payload")
            serialized, in_tree, out_tree = pickle.loads(payload)
            return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                             execution_devices=list(devices))
        except Exception as error:  # truncated, foreign or stale: compile instead
            if report is not None:
                report(f"stored executable {path.name} not loaded ({type(error).__name__}: {error}); compiling it")
            return None

    def save_reporting(self, key: str, compiled: jax.stages.Compiled, report: Callable[[str], None] | None) -> None:
        """:meth:`save`, where a failure (a full disk, an unserializable program) is only
        reported: the server runs without the entry."""
        try:
            self.save(key, compiled)
        except Exception as error:
            if report is not None:
                report(f"executable {key[:20]} not stored ({type(error).__name__}: {error})")

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        payload = pickle.dumps(serialize_executable.serialize(compiled))
        header = json.dumps({"format": FORMAT_VERSION, "key": key, "sha256": hashlib.sha256(payload).hexdigest()})
        self._write(self._path(key), header.encode() + b"\n" + payload)

    def load_number(self, key: str) -> int | None:
        """The number saved under ``key`` (:meth:`save_number`), or None: not saved, or
        unreadable (then it is measured again and replaced)."""
        try:
            fields = json.loads(self._number_path(key).read_text())
            if fields.get("format") == FORMAT_VERSION and fields.get("key") == key and type(fields.get("value")) is int:
                return fields["value"]
        except (OSError, ValueError):
            pass
        return None

    def save_number(self, key: str, value: int) -> None:
        """A number measured at start-up (the steps' temporary bytes), kept so that a warm
        start need not compile the steps that measure it. A store that cannot be written (a
        full disk, a read-only directory) keeps nothing: the number is measured again."""
        content = json.dumps({"format": FORMAT_VERSION, "key": key, "value": int(value)}).encode()
        try:
            self._write(self._number_path(key), content)
        except OSError:
            pass

    def _number_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _write(self, path: Path, content: bytes) -> None:
        """``content`` at ``path``, atomically: a temporary file of this process, then rename."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # a name of this process and call: two writers of one path never share a file
        partial = self.directory / f".{path.name}.partial-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            partial.write_bytes(content)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
