"""The same code on a mesh whose devices belong to two processes (gloo CPU collectives)."""

import json
import subprocess
import sys

import pytest
from subprocess_env import environ_without_device_count
from hf_tiny import make_tiny_hf_checkpoint

from shiftjax.checkpoints import convert_hf_checkpoint
from loopback import free_port

ARGS = ["--sp", "2", "--tp", "4", "--mode", "alternate", "--max-tokens", "8", "--json",
        "--max-model-len", "32", "--max-num-batched-tokens", "16", "--token-buckets", "8,16",
        "--seq-buckets", "2", "--prompt-ids", "1,5,9,40,77,3", "--prompt-ids", "1,64,65"]


def start(*args):
    env = {k: v for k, v in environ_without_device_count().items() if k != "JAX_PLATFORMS"}
    return subprocess.Popen([sys.executable, "-m", "shiftjax.serving.cli", "generate", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def outputs(process) -> list[list[int]]:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return [json.loads(line)["output_ids"] for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    hf_dir, _ = make_tiny_hf_checkpoint(tmp_path / "hf", "llama", num_heads=8, num_kv_heads=2,
                                        vocab_size=128, with_tokenizer=True, seed=2)
    model = str(convert_hf_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32"))
    coordinator = f"127.0.0.1:{free_port()}"
    workers = [start("--model", model, *ARGS, "--cpu-devices", "4", "--coordinator", coordinator,
                     "--num-processes", "2", "--process-id", str(i)) for i in range(2)]
    single = start("--model", model, *ARGS, "--cpu-devices", "8")
    expected = outputs(single)
    got = outputs(workers[0])
    assert outputs(workers[1]) == []  # only process 0 prints
    assert got == expected and len(got) == 2 and all(len(o) == 8 for o in got)
