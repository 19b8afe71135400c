"""serve's --gpu-allocator: applied before JAX's backends start (after, it would be silently
ignored, so it is refused), and the KV cache sized from the driver's memory under ``vmm``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shiftjax.serving.engine import cuda_free_memory as cuda_memory
from shiftjax.serving.engine.cuda_free_memory import cuda_free_and_total
from shiftjax.serving.engine.page_budget import device_memory
from shiftjax.serving.engine.xla_allocator import JAX_ALLOCATOR_VARIABLE, use_gpu_allocator


def test_unknown_allocator_is_refused():
    with pytest.raises(ValueError, match="must be one of"):
        use_gpu_allocator("cuda_async")


class _Device:
    def __init__(self, platform, stats, ordinal):
        self.platform, self._stats, self.local_hardware_id = platform, stats, ordinal

    def memory_stats(self):
        return self._stats


def test_the_pool_is_sized_from_the_driver_where_the_allocator_keeps_no_statistics(monkeypatch):
    """Under the VMM allocator a GPU reports no statistics: the driver's free and total
    memory stand in, the limit JAX's share of the total (the fullest device wins); a CPU
    still reports nothing."""
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    driver = {0: (110 * 2**30, 140 * 2**30), 1: (100 * 2**30, 140 * 2**30)}
    vmm = [_Device("gpu", None, 0), _Device("gpu", None, 1)]
    assert device_memory(vmm, driver_memory=driver.get) == (105 * 2**30, 40 * 2**30)  # 0.75 x 140
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # jaxlib's deprecated name
    assert device_memory(vmm, driver_memory=driver.get) == (70 * 2**30, 40 * 2**30)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")  # empty: unset, as jaxlib reads it
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.25")
    assert device_memory(vmm, driver_memory=driver.get) == (35 * 2**30, 40 * 2**30)
    bfc = _Device("gpu", {"bytes_limit": 100, "bytes_in_use": 40}, 0)
    assert device_memory([bfc, vmm[0]], driver_memory=driver.get) == (100, 40)
    assert device_memory(vmm, driver_memory=lambda ordinal: None) is None  # no driver
    assert device_memory([_Device("cpu", None, 0)], driver_memory=driver.get) is None
    assert device_memory([_Device("gpu", None, None)], driver_memory=driver.get) is None  # another process's


class _FakeDriver:
    """libcuda's four calls the query makes, answering through the pointers it is given."""

    def __init__(self, fail=None):
        self.fail, self.calls = fail, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuMemGetInfo_v2":
                args[0]._obj.value, args[1]._obj.value = 3 * 2**30, 8 * 2**30
            return 1 if name == self.fail else 0  # CUresult: 0 is success
        return call


@pytest.mark.parametrize("fail", [None, "cuInit", "cuDevicePrimaryCtxRetain", "cuMemGetInfo_v2"])
def test_the_driver_query_answers_or_says_none_and_releases_the_context(monkeypatch, fail):
    driver = _FakeDriver(fail)
    monkeypatch.setattr(cuda_memory, "_driver", lambda: driver)
    assert cuda_free_and_total(1) == (None if fail else (3 * 2**30, 8 * 2**30))
    if "cuDevicePrimaryCtxRetain" in driver.calls and fail != "cuDevicePrimaryCtxRetain":
        assert driver.calls[-1] == "cuDevicePrimaryCtxRelease_v2"  # pushed, popped, released
        assert driver.calls.count("cuCtxPushCurrent_v2") == driver.calls.count("cuCtxPopCurrent_v2") == 1
    monkeypatch.setattr(cuda_memory, "_driver", lambda: None)  # no NVIDIA driver
    assert cuda_free_and_total(0) is None


def test_default_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(JAX_ALLOCATOR_VARIABLE, raising=False)
    use_gpu_allocator("default")
    assert JAX_ALLOCATOR_VARIABLE not in os.environ


def test_vmm_is_set_before_the_backends_start_and_refused_after():
    """In a fresh process: the variable is set while JAX has no backend, and the call is
    refused once a device has been touched."""
    script = f"""
import os, jax
from shiftjax.serving.engine.xla_allocator import use_gpu_allocator
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
