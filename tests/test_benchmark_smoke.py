"""Every benchmark script runs at HEAD: each one's code path on tiny shapes on the CPU.

A benchmark that only runs on a lent GPU rots unseen (issue 11: decode_variants.py raised
TypeError at every commit after the step gained an argument, while the README quoted its
numbers). Each script runs here in a subprocess with ``--smoke``, through the GPU driver
script that runs it on the H200 where there is one (``SMOKE=1`` or ``BENCH_ARGS=--smoke``),
and the test checks what its output must say: the layer loops' HLO difference, the timer behind every number, the files the GPU call
brings back. A new script under benchmarks/ without a smoke run here fails
``test_every_script_is_smoke_tested``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# which test runs each script's --smoke path
VIA_GPU_SCRIPT = {"roofline.py", "decode_variants.py", "model_gpu.py",  # test_gpu_script_smoke
                  "layer_bench.py", "weight_layout_bench.py",  # test_layers_script_smoke
                  "attention_bench.py"}  # test_kernels_script_smoke
# test_script_smoke: script -> (arguments, the JSON file it must write into --out)
SCRIPTS = {"shift_x2.py": (["--smoke", "--engine-variants", "shipped,in_step_sampler"], "shift_x2.json"),  # (cublaslt: a GPU flag)
           "projection.py": (["--smoke"], "projection.json"),
           "dp_host_time.py": (["--smoke"], "dp_host_time.json"),
           "x8_checks.py": (["--dry-run"], "x8_checks.json"),
           "startup.py": (["--smoke"], "startup.json"),
           "replay_check.py": (["--smoke"], "replay_check.json"),
           "scheduler_host.py": (["--smoke"], "scheduler_host.json"),
           "idle_estimate.py": (["--smoke"], "idle_estimate.json"),
           "lowering_time.py": (["--smoke"], "lowering_time.json"),
           "dummy_start.py": (["--smoke"], "dummy_start.json"),
           "sp_exchange.py": (["--smoke"], "sp_exchange.json"),
           "collective_matmul.py": (["--smoke"], "collective_matmul.json"),
           "one_shot_all_reduce.py": (["--smoke", "--chain", "4"], "one_shot_all_reduce.json"),
           "command_buffer_log.py": (["--smoke"], "command_buffer_log.json"),
           "exchange_bandwidth.py": (["--smoke"], "exchange.json"),
           "decode_anatomy.py": (["--smoke", "--seqs", "8", "--gemm-rows", "8"], "decode_anatomy.json"),
           "decode_gemm_sweep.py": (["--smoke"], "decode_gemm_sweep.json"),
           "hostile_clients.py": (["--smoke"], "hostile_clients.json"),
           "structured_outputs.py": (["--smoke"], "structured_outputs.json"),
           "speculative_step.py": (["--smoke"], "speculative_step.json"),
           "drafter_host_cost.py": (["--smoke"], "drafter_host_cost.json"),
           "speculative_acceptance.py": (["--smoke", "--methods", "suffix"], "speculative_acceptance.json"),
           "speculative_served.py": (["--smoke"], "speculative_served.json"),
           "speculative_projection.py": (["--smoke"], "speculative_projection.json"),
           "fp8_gemm_bench.py": (["--smoke"], "fp8_gemm.json"),
           "fp8_kv_attention.py": (["--smoke"], "fp8_kv_attention.json"),
           "fp8_step.py": (["--smoke"], "fp8_step.json"),
           "fp8_accuracy.py": (["--smoke"], "fp8_accuracy.json"),
           "fp8_served.py": (["--smoke", "--deployments", "bf16,fp8_kv"], "fp8_served.json"),
           "fp8_served_anatomy.py": (["--smoke", "--quantization", "fp8", "--decode-steps", "5", "--profiled", "2"],
                                     "anatomy_fp8.json"),
           "remat_check.py": (["--smoke"], "remat_fp8.json"),
           "fp8_rows_bench.py": (["--smoke", "--iters", "2"], "rows_bench.json"),
           "hlo_fusions.py": (["--smoke"], "hlo_fusions.json")}
# restore_gpu.py --smoke runs in tests/test_sharded_restore.py, which checks its phases' results
SMOKED_ELSEWHERE = {"restore_gpu.py"}
SLOW = {"shift_x2.py", "x8_checks.py", "hostile_clients.py", "speculative_acceptance.py", "speculative_served.py",
        "fp8_served.py", "fp8_served_anatomy.py"}  # about a minute of wall clock each on a 2-core machine


def run(cmd, env_extra=None, timeout=900, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no 8-device flag of conftest
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env_extra or {}))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def test_every_script_is_smoke_tested():
    runnable = {p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert runnable, "no benchmark scripts found"
    missing = runnable - VIA_GPU_SCRIPT - SMOKED_ELSEWHERE - set(SCRIPTS)
    assert not missing, f"benchmark scripts with no smoke run in this test: {sorted(missing)}"
    for script in runnable:
        assert "--smoke" in (BENCH / script).read_text(), f"{script} has no --smoke mode"


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_gpu_script_smoke(tmp_path):
    """The one-call GPU script, end to end on the CPU: every step exits 0, the eight files
    come back, and their content says what the GPU run is for."""
    out = tmp_path / "out"
    log = run(["bash", "benchmarks/run_gpu_issue11.sh"],
              {"SMOKE": "1", "PY": sys.executable, "OUT": str(out), "COMMIT": "smoke-test"})
    steps = [line for line in (out / "env.txt").read_text().splitlines() + log.splitlines() if ": exit " in line]
    assert steps and all(": exit 0 " in line for line in steps), steps
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["ceilings.json", "decode_variants.json", "decode_variants.log", "decode_variants_dsfusion.log",
                     "env.txt", "model_gpu.json", "model_gpu.log", "pallas/model_gpu.json"]
    # at most 8 files, at most two folders down: what a device call brings back
    assert len(files) <= 8 and all(f.count("/") <= 1 for f in files)
    assert "commit: smoke-test" in (out / "env.txt").read_text()
    assert "blob " in (out / "env.txt").read_text()

    ceilings = json.loads((out / "ceilings.json").read_text())
    for name in ("copy", "read", "matmul"):
        assert ceilings[name]["best"] > 0
        assert ceilings[name]["timer"] == "host wall clock"  # no device trace on the CPU, and it says so

    decode = json.loads((out / "decode_variants.json").read_text())
    runs = {(r["loop"], r["sampling"]): r for r in decode["runs"]}
    assert set(runs) == {(loop, s) for loop in ("scan", "unrolled") for s in ("greedy", "sampled")}
    # The scan slices each of the 4 weight matrices out of the stack (one dynamic-slice in the
    # loop body each); the unrolled loop takes static slices, 4 per layer, no dynamic ones.
    scan, unrolled = runs["scan", "greedy"]["hlo"], runs["unrolled", "greedy"]["hlo"]
    assert scan["weight_dynamic_slices"] == 4, scan
    assert unrolled["weight_dynamic_slices"] == 0 and unrolled["weight_static_slices"] == 4 * 3, unrolled
    assert not scan["cache_moves"] and not unrolled["cache_moves"]
    for r in decode["runs"]:
        assert r["timer"] == "host wall clock" and r["step_ms"] > 0 and 0 < r["read_floor_over_step"]
    assert "--xla_gpu_enable_dynamic_slice_fusion=true" in (out / "decode_variants_dsfusion.log").read_text()

    model = json.loads((out / "model_gpu.json").read_text())
    assert not [k for k in model if k.endswith("_error")], model
    assert model["hlo_decode4_scan"]["weight_dynamic_slices"] == 4
    assert set(model["compile_seconds_by_layers"]) == {"2", "6"}
    pallas = json.loads((out / "pallas" / "model_gpu.json").read_text())
    assert pallas["pallas_vs_reference_float32"]["caches_equal"] is True


def test_layers_script_smoke(tmp_path):
    """run_gpu_layers.sh: both layer benchmarks; on the CPU the profiler has no device events,
    so every timed number must say it is host wall clock, in the lines and the summaries."""
    out = tmp_path / "out"
    run(["bash", "benchmarks/run_gpu_layers.sh"], {"SMOKE": "1", "PY": sys.executable, "OUT": str(out)})
    layer = (out / "layer.log").read_text()
    timed = [line for line in layer.splitlines() if "us/layer" in line and "layers" in line]
    assert len(timed) == 4 and all("[host wall clock: the profiler trace had no device events]" in t for t in timed)
    assert "| 16 | host wall clock |" in layer
    weights = (out / "weight_layout.log").read_text()
    timed = [line for line in weights.splitlines() if " us  floor " in line]
    assert timed and all("[host wall clock" in t for t in timed)
    assert "timers used: host wall clock" in weights
    rows = [line for line in weights.splitlines() if line.startswith("| SP | qkv | 8 |")]
    assert rows and rows[0].count("[wall]") == 4
    assert "read-only stream" in (out / "ceilings.txt").read_text()


def test_kernels_script_smoke(tmp_path):
    """run_gpu_kernels.sh's benchmark half: the attention benchmark in interpret mode."""
    out = tmp_path / "out"
    run(["bash", "benchmarks/run_gpu_kernels.sh"],
        {"TESTS": "0", "BENCH_ARGS": "--smoke", "PY": sys.executable, "OUT": str(out)})
    log = (out / "attention_bench.log").read_text()
    assert "WRONG" not in log and "Traceback" not in log
    assert [line for line in log.splitlines() if line.strip().startswith("case=")], log[-2000:]


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SCRIPTS
                                    if (BENCH / s).exists()])
def test_script_smoke(script, tmp_path):
    args, result = SCRIPTS[script]
    extra = ["--workdir", str(tmp_path / "work")] if script == "restore_gpu.py" else []
    if script == "projection.py":  # a 30-request trace keeps the replay short (the default is 8,819)
        trace = tmp_path / "trace.csv"
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"2023-11-16 18:17:{i:02d}.0000000,{300 + 37 * i},{5 + i % 4}\n" for i in range(30)))
        extra = ["--trace", str(trace)]
    output = run([sys.executable, f"benchmarks/{script}", *args, "--out", str(tmp_path), *extra])
    data = json.loads((tmp_path / result).read_text())
    assert data, output[-2000:]
    if script == "fp8_served_anatomy.py":  # the prompt ran as one 64-token step, decode in 16-token ones
        assert data["ttft"]["executables"] == {"tp/64/1": 1}, data["ttft"]
        assert data["decode"]["executables"] == {"tp/16/1": 2}, data["decode"]
    if script == "remat_check.py":  # every variant compiled and ran; the engine's options remat nothing
        variants = data["variants"]
        assert set(variants) == {"small_cache", "full_cache_xla_default", "full_cache_compiled_first", "full_cache"}
        assert all("ms_median" in row for row in variants.values()), variants
        assert variants["full_cache"]["remat_instructions"] == 0, variants
    if script == "hlo_fusions.py":  # the dumped function's fusion read back, its cosine inside
        assert any("cosine(" in text for kernels in data.values() for text in kernels.values()), data
    if script == "fp8_rows_bench.py":  # every op timed both ways; the kernels agree with XLA's passes
        assert len(data["cases"]) == 3 and all(c["agreement"]["rel_error"] < 0.05 for c in data["cases"]), data
    if script == "sp_exchange.py":  # the exchanges change transfers, not the arithmetic
        assert all(data[name]["logits_equal_shipped"] for name in ("permute1", "permute2")), output[-2000:]
    if script == "one_shot_all_reduce.py":  # (psum alone on the CPU) both devices hold the same sum
        sums = [row for key, row in data.items() if ":rows" in key and ":chain" not in key]
        assert len(sums) == 8 and all(row["devices_agree"] and row["repeats_agree"] for row in sums), data
    if script == "speculative_acceptance.py":  # every method kept the output of no speculation
        assert all(run["outputs_equal_no_speculation"] for name, runs in data["runs"].items() if name != "none"
                   for run in runs.values()), data
    if script == "speculative_served.py":  # the same tokens served with and without speculation
        assert all(run["tokens_equal_none"] for d in data["deployments"].values() for run in d["runs"].values())
        assert data["deployments"]["ngram"]["runs"]["repeating_c1"]["drafts"] > 0, data
    if script == "speculative_projection.py":  # 2 tokens a step, half the steps drafted, verification ~free
        speedup = data["rows"]["ngram_k3/code_edit"]["projected_speedup_by_seqs"]
        assert 1.9 < speedup["1"] <= 2.0 and speedup["64"] < speedup["1"], data
    if script == "speculative_step.py":  # both layouts timed, the ratio to one token a sequence
        assert {(r["layout"], r["tokens_per_seq"]) for r in data["steps"]} == {
            ("rows", 1), ("rows", 2), ("rows", 3), ("chunk", 2), ("chunk", 3)}
        assert all(r["ms"] > 0 and r["ratio_to_one"] > 0 for r in data["steps"])
    if script == "exchange_bandwidth.py":  # every exchange size timed (XLA's alone on the CPU)
        assert len(data) == 7 and all(row["nccl"]["us"] > 0 for row in data.values())
    if script == "hostile_clients.py":  # issue 31: no 5xx, nothing lost, a clean drain
        assert not [code for code in data["http_bodies"]["answers"] if str(code).startswith("5")], data["http_bodies"]
        assert data["greedy_unchanged"] and data["sigterm"]["exit_status"] == 0, data
        assert data["server_log"]["traceback_lines"] == data["server_log"]["error_lines"] == 0, data["server_log"]
    if script == "decode_anatomy.py":  # the decode step found (the engine's ladder) and its HLO read back
        decode = data["anatomy::"]["decode8"]
        assert decode["executable"] == ["tp", 16, 8] and decode["hlo_instructions_from_model"] > 0, decode
        # K and V, 2 layers, 1 KV head of 32 (the smoke shape's TP-2 shard) in bf16, for 8 contexts
        assert decode["kv_bytes"] == 8 * decode["context_at_least"] * 2 * 2 * 1 * 32 * 2, decode
    if script == "decode_gemm_sweep.py":  # the interpret-mode kernels matched the reference (it exits 1 otherwise):
        # a split-K config and the SwiGLU kernel among them; and the real shapes lower to Triton
        timed = {key: set(result["all_us"]) for key, result in data["results"].items()}
        assert any("_sk1_" not in c for c in timed["proj:16"]) and timed["gate_up_swiglu:16"], timed
        assert set(data["cuda_lowering"].values()) == {"ok"}, data["cuda_lowering"]
    if script == "shift_x2.py":  # every engine variant decodes the same greedy tokens (same arithmetic)
        assert data["engine"]["same_tokens_everywhere"] is True, output[-2000:]
        assert set(data["xla_options"]) >= {"skip_temp", "no_command_buffers"}, data["xla_options"]
        assert data["collectives"]["one_shot_lowered"] is True  # the kernels' chains lower (GPU-only to run)


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


def test_hlo_report_sees_a_layer_slice_in_synthetic_hlo():
    """A dynamic-slice of one layer out of a [32, 1, 4096, 6144] stack, inside a fusion whose
    parameter is the stack: the shape the first report missed ((1, 1, K, N))."""
    sys.path.insert(0, str(BENCH))
    try:
        import hlo_moves
    finally:
        sys.path.remove(str(BENCH))

    hlo = """
%fused_computation.7 (param_0.75: bf16[32,1,4096,6144], param_1.120: s32[]) -> bf16[1,1,4096,6144] {
  %param_0.75 = bf16[32,1,4096,6144]{3,2,1,0} parameter(0)
  %param_1.120 = s32[] parameter(1)
  %constant.492 = s32[] constant(0)
  ROOT %dynamic-slice.3 = bf16[1,1,4096,6144]{3,2,1,0} dynamic-slice(%param_0.75, %param_1.120, %constant.492, %constant.492, %constant.492), dynamic_slice_sizes={1,1,4096,6144}
}
%fused_computation.8 (param_0.9: bf16[8,4096]) -> bf16[8,4096] {
  %param_0.9 = bf16[8,4096]{1,0} parameter(0)
  ROOT %copy.1 = bf16[8,4096]{1,0} copy(%param_0.9)
}
"""
    stacks = {(32, 1, 4096, 6144)}
    moves = hlo_moves.find_moves(hlo, stacks, hlo_moves.leading_one_variants((32, 1, 4096, 6144), 2))
    assert [(m["op"], m["shape"], m["operand_shape"]) for m in moves] == [
        ("dynamic-slice", (1, 1, 4096, 6144), (32, 1, 4096, 6144))]
    # by operand origin alone, even if the result shape were not listed
    assert len(hlo_moves.find_moves(hlo, stacks, set())) == 1
    assert hlo_moves.leading_one_variants((32, 1, 4096, 6144), 2) == {
        (32, 1, 4096, 6144), (1, 1, 4096, 6144), (1, 4096, 6144), (4096, 6144)}


def test_idle_estimate_of_a_measured_engine_run():
    """idle_estimate.py on the committed 2x H200 engine run: a row per profiled (step, GPU),
    and counting the all-reduces as idle can only raise the idle fraction."""
    sys.path.insert(0, str(BENCH))
    import idle_estimate

    with open(idle_estimate.MEASURED) as f:
        rows = idle_estimate.estimates(json.load(f)["engine"])
    assert len(rows) == 3 * 2 * 3 * 2  # variants x loops x sequence counts x GPUs
    for r in rows:
        assert r["collective_ms"] > 0 and r["idle_high"] > r["idle_low"]
        assert 0 < r["idle_high"] < 1 and r["kernel_ms"] > 0
