"""Test setup: 8 virtual CPU devices and run-time shape checks, before JAX is imported."""

import os

from subprocess_env import CPU_CODEGEN_FLAGS

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {CPU_CODEGEN_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtyping import install_import_hook  # noqa: E402

# Every jaxtyping annotation in the package is checked at run time during the tests.
install_import_hook("shiftjax", "beartype.beartype")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run: the in-process engines of every test
# file and worker, and the servers the tests start (`shiftjax serve` defaults to the same
# folder), so that an executable compiled once in the run is loaded, not compiled, after.
from shiftjax.serving.engine.engine_args import default_compilation_cache_dir  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(default_compilation_cache_dir()))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


try:  # the transformers oracle: one thread is ~15x faster than two on this 2-core machine
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers), the controller prepares the
    default model's checkpoint once before the workers start, so that no two of them
    import the GGUF into the same cache at once."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from shiftjax.checkpoints.default_model import default_model_path

        default_model_path()


# The files that take longest (summed test time of a whole `make test` run on the 2-core
# machine, JUnit XML), started first: xdist's --dist loadfile hands files out in collection
# order, and a long file started last leaves the other worker idle at the end. An order
# only; a file missing here runs after these, in its usual place.
LONGEST_FIRST = ("test_benchmark_smoke", "test_parallel", "test_cli", "test_speculative_engine",
                 "test_grpc_default_model", "test_openai_structured_e2e", "test_executable_store",
                 "test_dummy_weights", "test_fp8_kv_cache", "test_kernels", "test_data_parallel",
                 "test_structured_outputs_engine", "test_smollm2", "test_engine")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        stem = item.path.stem
        matches = [i for i, name in enumerate(LONGEST_FIRST) if stem == name or stem.startswith(name + "_")]
        return matches[0] if matches else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept
