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


@pytest.mark.parametrize(
    "name, hidden, intermediate, layers, heads",
    [("Qwen3-8B", 4096, 12288, 36, 32), ("Qwen3-32B", 5120, 25600, 64, 64)],
)
def test_qwen3_configs(name, hidden, intermediate, layers, heads):
    config = ModelConfig.from_json_file(CONFIGS / name / "config.json")
    assert config.architecture == "qwen3" and config.qk_norm and not config.qkv_bias
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (hidden, intermediate, layers)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (heads, 8, 128)
    assert config.vocab_size == 151936 and config.max_position_embeddings == 40960
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (1e6, None, 1e-6)
    assert config.tie_word_embeddings is False


COMPARE = CONFIGS / "compare"


@pytest.mark.parametrize("prefix", ["cpu_default", "cpu_x2_default", "h200x2_llama8b"])
def test_compare_files_read_and_plan(prefix, monkeypatch):
    from shiftjax.serving.bench.compare import planned_runs, read_workloads
    from shiftjax.serving.bench.server_process import read_deployments

    deployments, meta = read_deployments(COMPARE / f"{prefix}_deployments.json")
    assert meta["device"] and {d.name for d in deployments} == {"tp", "sp", "shift", "shift-threshold", "dp"}
    specs = read_workloads([str(COMPARE / f"{prefix}_workloads.json")])
    uses_http = any(s.options.get("backend") == "openai" for s in specs)
    assert all("{port}" in d.command and ("{http_port}" in d.command or not uses_http) for d in deployments)
    monkeypatch.chdir(CONFIGS.parents[1])  # trace paths are relative to the repository root
    runs = planned_runs([s for s in specs if s.options.get("dataset") != "trace" or prefix.startswith("cpu")],
                        {"vocab_size": 1000})
    assert runs and all(len(workload.requests) > 0 for *_, workload in runs)


@pytest.mark.parametrize("prefix", ["h200x2_llama8b", "h200x8_llama70b", "h200x2_allocator", "h200x2_all_reduce"])
def test_gpu_compare_files_need_nothing_the_gpu_machines_lack(prefix):
    """The GPU machines run the checkout uninstalled, without FastAPI or the default
    model's GGUF package: their servers start through ``{python} -P -m``, serve gRPC only,
    and take the default model's tokenizer from the repository."""
    from shiftjax.serving.bench.server_process import read_deployments

    deployments, _ = read_deployments(COMPARE / f"{prefix}_deployments.json")
    for d in deployments:
        command = " ".join(d.command)
        assert command.startswith("{python} -P -m shiftjax.serving.cli serve "), command
        assert "--http-port" not in command and "--tokenizer benchmarks/configs/smollm2-tokenizer" in command
        assert "--executable-store" in command  # later deployments start warm from earlier ones' steps
        assert d.env.get("NCCL_NVLS_ENABLE") == "0"


def test_committed_tokenizer_is_the_default_models():
    """benchmarks/configs/smollm2-tokenizer is the default model's tokenizer, byte for byte."""
    from shiftjax.checkpoints.default_model import default_model_path

    checkpoint = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (CONFIGS / "smollm2-tokenizer" / name).read_bytes() == (checkpoint / name).read_bytes(), name
