"""Every benchmark script runs at HEAD: each one's code path on tiny shapes on the CPU.

A benchmark that only runs on a GPU rots unseen: a script that raised at every commit after
the step gained an argument once had its numbers quoted in the README. Each script runs here
in a subprocess with ``--smoke``, through the GPU driver (``SMOKE=1 bash benchmarks/run_gpu.sh
PART ...``) where a part of it runs the script, and the test checks what its output must say:
the timer behind every number, the kernels an anatomy names, the same tokens from every
variant. A new script under benchmarks/ without a smoke run fails
``test_every_script_is_smoke_tested``. The runs are split over this file and
tests/test_benchmark_smoke_scripts.py (``SCRIPTS`` here, ``SCRIPTS_THERE`` there), so that
the test run's two workers share them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import environ_without_device_count

from shiftjax.serving.engine.engine_args import default_compilation_cache_dir

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# which test runs each script's --smoke path
VIA_RUN_GPU = {"roofline.py", "attention_bench.py", "fp8_gemm_bench.py",  # test_run_gpu_ceilings_and_kernels
               "decode_anatomy.py", "served_anatomy.py", "hlo_fusions.py"}  # test_run_gpu_anatomy
# test_script_smoke: script -> (arguments, the JSON file it must write into --out); the other
# scripts' runs are in tests/test_benchmark_smoke_scripts.py
SCRIPTS = {"x8_checks.py": (["--dry-run"], "x8_checks.json"),
           "served.py": (["--smoke", "--deployments", "bf16,fp8_kv"], "served.json")}
SCRIPTS_THERE = {"shift_x2.py", "startup.py", "dummy_start.py", "replay_check.py"}
# restore_gpu.py --smoke runs in tests/test_sharded_restore.py, which checks its phases' results;
# projection.py --smoke in tests/test_projection.py, which checks its report
SMOKED_ELSEWHERE = {"restore_gpu.py", "projection.py"}
SLOW = {"shift_x2.py", "x8_checks.py", "served.py"}  # a minute or more of wall clock each on a 2-core machine


def run(cmd, env_extra=None, timeout=900, cwd=ROOT, compilation_cache=True):
    """``cmd`` on the CPU; ``compilation_cache``: with the test run's persistent XLA
    compilation cache (tests/conftest.py's), so that what one run compiles the next loads."""
    env = environ_without_device_count()  # no 8-device flag of conftest
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    if compilation_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=str(default_compilation_cache_dir()),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def run_gpu(out: Path, *parts: str, **env) -> str:
    """``SMOKE=1 bash benchmarks/run_gpu.sh PARTS``: every step must exit 0."""
    log = run(["bash", "benchmarks/run_gpu.sh", *parts],
              {"SMOKE": "1", "PY": sys.executable, "OUT": str(out), "COMMIT": "smoke-test", **env})
    steps = (out / "steps.txt").read_text().splitlines()
    assert steps and all(": exit 0 " in line for line in steps), steps
    env_txt = (out / "env.txt").read_text()
    assert "commit: smoke-test" in env_txt and "blob " in env_txt
    return log


def test_every_script_is_smoke_tested():
    runnable = {p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert runnable, "no benchmark scripts found"
    missing = runnable - VIA_RUN_GPU - SMOKED_ELSEWHERE - set(SCRIPTS) - SCRIPTS_THERE
    assert not missing, f"benchmark scripts with no smoke run in these tests: {sorted(missing)}"
    from test_benchmark_smoke_scripts import SCRIPTS as scripts_there  # the other file's table
    assert set(scripts_there) == SCRIPTS_THERE and not SCRIPTS_THERE & set(SCRIPTS), (set(scripts_there), SCRIPTS_THERE)
    for script in runnable:
        assert "--smoke" in (BENCH / script).read_text(), f"{script} has no --smoke mode"
    driver = (BENCH / "run_gpu.sh").read_text()
    assert all(f"benchmarks/{script}" in driver for script in VIA_RUN_GPU)


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_run_gpu_names_its_parts():
    """No part: the header's list of parts and exit 2; an unknown part: exit 2 before anything runs."""
    listing = subprocess.run(["bash", "benchmarks/run_gpu.sh"], cwd=ROOT, capture_output=True, text=True)
    assert listing.returncode == 2 and "before_after" in listing.stdout, listing.stdout + listing.stderr
    unknown = subprocess.run(["bash", "benchmarks/run_gpu.sh", "no_such_part"], cwd=ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown part no_such_part" in unknown.stderr, unknown.stderr


def test_run_gpu_ceilings_and_kernels(tmp_path):
    """The parts ceilings and kernels: on the CPU the profiler has no device events, so every
    ceiling says it is host wall clock; the attention benchmark runs in interpret mode and
    its kernels match the reference; the FP8 GEMMs' XLA rows are timed and checked."""
    out = tmp_path / "out"
    run_gpu(out, "ceilings", "kernels")
    ceilings = json.loads((out / "ceilings.json").read_text())
    for name in ("copy", "read", "matmul"):
        assert ceilings[name]["best"] > 0
        assert ceilings[name]["timer"] == "host wall clock"  # no device trace on the CPU, and it says so
    log = (out / "attention_bench.log").read_text()
    assert "WRONG" not in log and "Traceback" not in log
    assert [line for line in log.splitlines() if line.strip().startswith("case=")], log[-2000:]
    fp8 = json.loads((out / "fp8_gemm" / "fp8_gemm.json").read_text())
    assert fp8["rows"], fp8


def test_run_gpu_anatomy(tmp_path):
    """The part anatomy: the engine's decode step found and its HLO read back; the served
    engine's prompt as one 64-token step and decode in 16-token ones; a dumped fusion read back."""
    out = tmp_path / "out"
    run_gpu(out, "anatomy", QUANTIZATIONS="fp8", SHAPE="tp2_shard")  # the one-GPU share of the TP-2 step
    data = json.loads((out / "decode_anatomy" / "decode_anatomy.json").read_text())
    decode = data["anatomy::"]["decode8"]
    assert decode["executable"] == ["tp", 16, 8] and decode["hlo_instructions_from_model"] > 0, decode
    # K and V, 2 layers, 1 KV head of 32 (the smoke shape's TP-2 shard) in bf16, for 8 contexts
    assert decode["kv_bytes"] == 8 * decode["context_at_least"] * 2 * 2 * 1 * 32 * 2, decode
    served = json.loads((out / "served_anatomy" / "anatomy_fp8.json").read_text())
    assert served["ttft"]["executables"] == {"tp/64/1": 1}, served["ttft"]
    assert served["decode"]["executables"] == {"tp/16/1": 2}, served["decode"]
    fusions = json.loads((out / "fusions_fp8" / "hlo_fusions.json").read_text())
    assert any("cosine(" in text for kernels in fusions.values() for text in kernels.values()), fusions


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SCRIPTS])
def test_script_smoke(script, tmp_path):
    smoke_script(script, SCRIPTS[script], tmp_path)


def smoke_script(script, spec, out: Path, compilation_cache=True) -> dict:
    """``script`` with its ``--smoke`` arguments and ``--out``: it exits 0 and writes its JSON."""
    args, result = spec
    output = run([sys.executable, f"benchmarks/{script}", *args, "--out", str(out)], compilation_cache=compilation_cache)
    data = json.loads((out / result).read_text())
    assert data, output[-2000:]
    return data


_ANATOMY_HLO = """HloModule m

FileNames
1 "/x/shiftjax/model.py"

FunctionNames
1 "rms_norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=36 end_line=36 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%fused_computation.3 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %multiply.1 = f32[8]{0} multiply(%param_0, %param_0), metadata={op_name="jit(step)/mul" stack_frame_id=1}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %custom-call.1 = f32[8]{0} custom-call(%p), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/dot_general" source_file="/x/shiftjax/model.py" source_line=120}
  ROOT %loop_multiply_fusion.3 = f32[8]{0} fusion(%custom-call.1), kind=kLoop, calls=%fused_computation.3
}
"""


def test_decode_anatomy_names_each_kernel_by_its_hlo_and_source_line():
    """A fusion's kernel is found by its name (its fused root's stack frame gives the line);
    a library kernel by XLA's hlo_op annotation; times and calls are per step."""
    sys.path.insert(0, str(BENCH))
    from decode_anatomy import by_source, hlo_instructions, kernel_table
    hlo = hlo_instructions(_ANATOMY_HLO)
    events = [(0, 10, 10_000, "loop_multiply_fusion_3", {}), (20, 30, 3_000, "nvjet_sm90_tst", {"hlo_op": "custom-call.1"}),
              (40, 50, 10_000, "loop_multiply_fusion_3", {}), (60, 70, 3_000, "nvjet_sm90_tst", {"hlo_op": "custom-call.1"})]
    norm, gemm = kernel_table(events, 2, hlo)
    assert (norm["kernel"], norm["us"], norm["calls"], norm["source"], norm["op_name"]) == \
        ("loop_multiply_fusion_3", 10.0, 1.0, "model.py:36 rms_norm", "mul")
    assert (gemm["kind"], gemm["us"], gemm["target"], gemm["source"]) == ("gemm", 3.0, "__cublas$lt$matmul", "model.py:120")
    assert [row["source"] for row in by_source([norm, gemm])] == ["model.py:36 rms_norm", "model.py:120"]
    from roofline import kernel_kind  # shiftjax's own collectives count as collectives, not fusions
    assert {kernel_kind(f"(anonymous namespace)::{k}(__nv_bfloat16 const*") for k in ("one_shot_kernel", "exchange_kernel")} \
        == {"collective"}
