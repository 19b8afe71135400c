"""``shiftjax serve`` as a subprocess on the default model (sp 2 x tp 2, CPU): start-up
lines, the bearer token on both front ends, and SIGTERM draining a running request to
its end before exiting 0."""

import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from shiftjax.serving.client.grpc_client import Client
from loopback import free_port

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--cpu-devices", "4", "--sp", "2", "--tp", "2", "--max-model-len", "128", "--num-pages", "32",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "16,64",
               "--seq-buckets", "4", "--shift-threshold", "32"]


class ServeProcess:
    """``shiftjax serve`` with its stderr collected line by line on a thread."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen([sys.executable, "-m", "shiftjax.serving.cli", "serve", *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, pattern: str, seconds: float) -> re.Match:
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}; stderr so far:\n" + "\n".join(self.lines))

    def log(self) -> str:
        return "\n".join(self.lines)


def test_sigterm_drains_running_requests_then_exits_0(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("tok-123\n")
    http_port = free_port()
    server = ServeProcess(*ENGINE_ARGS, "--port", "0", "--http-port", str(http_port), "--api-key-file", str(key_file),
                          "--grace-seconds", "60")
    try:
        address = server.wait_for_line(r"serving gRPC on (\S+)", 300).group(1)
        assert "page pool:" in server.log() and "health NOT_SERVING until" in server.log()
        with Client(address, api_key="tok-123", timeout=120.0) as client, Client(address, timeout=10.0) as anonymous:
            assert client.health() == "SERVING"
            with pytest.raises(grpc.RpcError) as caught:
                anonymous.info()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            import httpx

            assert httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).status_code == 401
            models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10,
                               headers={"Authorization": "Bearer tok-123"})
            assert models.status_code == 200

            running = client.generate(prompt_ids=[1, 2, 3], max_tokens=40, ignore_eos=True)
            received = list(next(running).token_ids)
            server.process.send_signal(signal.SIGTERM)
            server.wait_for_line("draining", 10)
            assert client.health() in ("NOT_SERVING", "UNREACHABLE")
            with pytest.raises(grpc.RpcError) as caught:
                client.complete(prompt_ids=[4, 5], max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            last = None
            for response in running:
                received += response.token_ids
                last = response
            assert len(received) == 40 and last.finish_reason == 2  # FINISH_REASON_LENGTH: ran to its end
        assert server.process.wait(60) == 0, server.log()
        assert "stopped" in server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)
