"""The benchmark model shapes in benchmarks/configs/ read as the models they name."""

from pathlib import Path

import pytest

from shiftjax.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"


@pytest.mark.parametrize(
    "name, hidden, intermediate, layers, heads",
    [("Llama-3.1-8B", 4096, 14336, 32, 32), ("Llama-3.1-70B", 8192, 28672, 80, 64)],
)
def test_llama31_configs(name, hidden, intermediate, layers, heads):
    config = ModelConfig.from_json_file(CONFIGS / name / "config.json")
    assert config.architecture == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (hidden, intermediate, layers)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, 8, 128)
    assert config.vocab_size == 128256
    assert config.rope_theta == 500000.0
    assert config.max_position_embeddings == 131072
    assert config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings is False
    scaling = config.rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (8.0, 1.0, 4.0)
    assert scaling.original_max_position_embeddings == 8192


COMPARE = CONFIGS / "compare"


@pytest.mark.parametrize("prefix", ["cpu_default", "h200x2_llama8b"])
def test_compare_files_read_and_plan(prefix, monkeypatch):
    from shiftjax.serving.bench.compare import planned_runs, read_workloads
    from shiftjax.serving.bench.server_process import read_deployments

    deployments, meta = read_deployments(COMPARE / f"{prefix}_deployments.json")
    assert meta["device"] and {d.name for d in deployments} == {"tp", "sp", "shift", "shift-threshold", "dp"}
    assert all("{port}" in d.command and "{http_port}" in d.command for d in deployments)
    specs = read_workloads([str(COMPARE / f"{prefix}_workloads.json")])
    monkeypatch.chdir(CONFIGS.parents[1])  # trace paths are relative to the repository root
    runs = planned_runs([s for s in specs if s.options.get("dataset") != "trace" or prefix == "cpu_default"],
                        {"vocab_size": 1000})
    assert runs and all(len(workload.requests) > 0 for *_, workload in runs)
