"""The environment for a child process that makes its own CPU devices."""

import os

# XLA:CPU's code generation for the whole test run, this process and its children alike (so
# that a server or a script computes what the in-process engines do): the elemental IR
# emitters instead of the MLIR fusion emitters. On the 2-core test machine they compile
# test_parallel.py's 16-head cases in 54 s instead of 88 s, and a SmolLM2 engine on an
# sp 2 x tp 2 mesh decodes 8 rows faster, not slower.
CPU_CODEGEN_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def environ_without_device_count() -> dict[str, str]:
    """This process's environment less conftest.py's ``--xla_force_host_platform_device_count``
    (its ``CPU_CODEGEN_FLAGS`` kept)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env
