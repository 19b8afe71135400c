"""``shiftjax client`` and the Python clients against the fake service: streamed text,
info, errors, the async client, and that a client process never imports JAX."""

import asyncio
import json
import subprocess
import sys

import pytest

from grpc_harness import FakeEngineService, ServerThread, expected_output
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.tokenizer import Tokenizer
from shiftjax.serving.client.cli import client_main


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_path())


@pytest.fixture(scope="module")
def server(tokenizer):
    thread = ServerThread(FakeEngineService(tokenizer))
    yield thread
    thread.stop()


def test_generate_streams_the_text_and_summarises_to_stderr(server, tokenizer, capsys):
    assert client_main(["generate", "--server", server.address, "--prompt-ids", "1,2", "--max-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == tokenizer.decode(expected_output([1, 2], 6)) + "\n"
    assert "[length; 2 prompt (0 cached) + 6 output tokens;" in err and "steps by mode: tp x6]" in err


def test_the_cache_salt_reaches_the_service(server, capsys):
    fake = server.server.servicer.service
    assert client_main(["generate", "--server", server.address, "--prompt-ids", "1,2", "--max-tokens", "1",
                        "--cache-salt", "tenant-a"]) == 0
    assert fake.submitted[-1].cache_salt == "tenant-a"
    assert client_main(["generate", "--server", server.address, "--prompt-ids", "1,2", "--max-tokens", "1"]) == 0
    assert fake.submitted[-1].cache_salt is None  # an empty proto string: no salt


def test_chat_json_lines_and_info(server, tokenizer, capsys):
    assert client_main(["chat", "--server", server.address, "hello", "--max-tokens", "3", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and lines[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert client_main(["info", "--server", server.address]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"] == "fake" and info["free_pages"] == 256 and info["info"]["policy"]["name"] == "auto"


def test_a_refused_request_prints_the_status_and_exits_1(server, capsys):
    assert client_main(["generate", "--server", server.address, "--prompt-ids", "1", "--max-tokens", "0"]) == 1
    assert "INVALID_ARGUMENT: max_tokens:" in capsys.readouterr().err


def test_async_client_streams_concurrently(server):
    from shiftjax.serving.client.grpc_client import AsyncClient

    async def run():
        async with AsyncClient(server.address, timeout=30.0) as client:
            completions = await asyncio.gather(*(client.complete(prompt_ids=[i + 1], max_tokens=4) for i in range(20)))
            assert await client.health() == "SERVING"
            assert (await client.info()).model == "fake"
            return completions

    completions = asyncio.run(run())
    assert [c.token_ids for c in completions] == [expected_output([i + 1], 4) for i in range(20)]


def test_the_client_imports_no_jax():
    code = ("import sys, shiftjax.serving.client.cli, shiftjax.serving; shiftjax.serving.Client; "
            "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
