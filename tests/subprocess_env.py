"""The environment for a child process that makes its own CPU devices."""

import os


def environ_without_device_count() -> dict[str, str]:
    """This process's environment less conftest.py's ``--xla_force_host_platform_device_count``."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env
