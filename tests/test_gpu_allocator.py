"""serve's --gpu-allocator: validated with the other options, and applied before JAX's
backends start (after, it would be silently ignored, so it is refused)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shiftjax.serving.gpu_allocator import JAX_ALLOCATOR_VARIABLE, gpu_allocator_error, use_gpu_allocator
from shiftjax.serving.serve_cli import serve_main


def test_vmm_needs_a_page_count():
    assert gpu_allocator_error("default", None) is None
    assert gpu_allocator_error("vmm", 4096) is None
    assert "--num-pages" in gpu_allocator_error("vmm", None)
    with pytest.raises(ValueError, match="must be one of"):
        use_gpu_allocator("cuda_async")


def test_serve_refuses_vmm_without_num_pages_before_starting(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--gpu-allocator", "vmm", "--port", "0"])
    assert exit_info.value.code == 2
    assert "--gpu-allocator vmm keeps no memory statistics" in capsys.readouterr().err


def test_default_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(JAX_ALLOCATOR_VARIABLE, raising=False)
    use_gpu_allocator("default")
    assert JAX_ALLOCATOR_VARIABLE not in os.environ


def test_vmm_is_set_before_the_backends_start_and_refused_after():
    """In a fresh process: the variable is set while JAX has no backend, and the call is
    refused once a device has been touched."""
    script = f"""
import os, jax
from shiftjax.serving.gpu_allocator import use_gpu_allocator
use_gpu_allocator("vmm")
print("set", os.environ["{JAX_ALLOCATOR_VARIABLE}"])
jax.devices()
try:
    use_gpu_allocator("vmm")
except RuntimeError as error:
    print("refused", "already set up" in str(error))
"""
    env = {k: v for k, v in os.environ.items() if k != JAX_ALLOCATOR_VARIABLE}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["set", "vmm", "refused", "True"]
