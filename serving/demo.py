"""``make demo`` (``python -m shiftjax.serving.demo``): the server's main job in three minutes.

Starts ``shiftjax serve`` on the default model (SmolLM2-135M-Instruct) on a 2 x 2 mesh of
virtual CPU devices, waits for its health check, streams one request through the gRPC
client, then sends a burst of concurrent ones, and prints the mode (TP or SP) of every
step each request ran in. The shift policy is a threshold: steps whose token bucket is at
least ``SHIFT_THRESHOLD`` run in SP mode, smaller ones in TP mode, so the lone request's
decode steps (one token each, bucket 2) run TP and the burst's steps (bucket 16) run SP.
The demo checks that this happened, prints a few Prometheus metrics scraped from the
server's ``--metrics-port``, stops the server with SIGTERM and checks that it exits 0.

The bucket ladder is small on purpose (token buckets 2 and 16, sequence buckets 1 and 8:
3 pairs, 6 executables over the two modes) so that a 2-core machine compiles it in under
a minute; the persistent compilation cache (``.cache/shiftjax/xla``) makes a second run
load them instead. The first run on a fresh machine also imports the default model once
(``.cache/shiftjax``).
Exit status: 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import subprocess
import sys
import threading
import time
import urllib.request

SHIFT_THRESHOLD = 8
TOKEN_BUCKETS = "2,16"
SEQ_BUCKETS = "1,8"
BURST_PROMPTS = (
    "The three laws of motion are",
    "A recipe for pancakes starts with",
    "The largest planet in the solar system",
    "In the year 1969, astronauts",
    "Photosynthesis is the process by which",
    "The capital of Japan is",
    "A good night's sleep helps",
    "The first computer programmers were",
)
SERVE_ARGS = ("--cpu-devices", "4", "--sp", "2", "--tp", "2", "--mode", "auto",
              "--shift-threshold", str(SHIFT_THRESHOLD), "--token-buckets", TOKEN_BUCKETS,
              "--seq-buckets", SEQ_BUCKETS, "--max-model-len", "128", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "16", "--grace-seconds", "30")


def _runs(modes) -> str:
    """``['sp', 'sp', 'tp']`` -> ``'sp x2, tp x1'``: a step trace in one line."""
    return ", ".join(f"{mode} x{len(list(group))}" for mode, group in itertools.groupby(modes)) or "none"


class Server:
    """``shiftjax serve`` as a child process, its stderr echoed with a prefix."""

    def __init__(self, grpc_port: int, metrics_port: int, extra: list[str]):
        command = [sys.executable, "-m", "shiftjax.serving.cli", "serve", *SERVE_ARGS, "--port", str(grpc_port),
                   "--metrics-port", str(metrics_port), *extra]
        print("$ shiftjax serve " + " ".join(command[4:]), flush=True)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.quiet = False
        threading.Thread(target=self._echo, daemon=True).start()

    def _echo(self):
        for line in self.process.stderr:
            if not self.quiet or "WARNING" in line or "ERROR" in line:
                print(f"  [server] {line.rstrip()}", flush=True)

    def wait_until_serving(self, client, timeout: float) -> None:
        give_up = time.monotonic() + timeout
        while (status := client.health()) != "SERVING":
            if self.process.poll() is not None:
                raise RuntimeError(f"shiftjax serve exited with status {self.process.returncode} during start-up")
            if time.monotonic() > give_up:
                raise TimeoutError(f"the server was not SERVING after {timeout:.0f} s (health: {status})")
            time.sleep(0.5)

    def stop(self, timeout: float) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def single_request(client, max_tokens: int) -> list[str]:
    """Streams one chat answer to the terminal; returns the modes of its decode steps."""
    from shiftjax.serving.client.grpc_client import Completion

    question = "What is the capital of France?"
    print(f"\n== one request (chat): {question!r}\n", flush=True)
    completion = Completion()
    for response in client.chat([{"role": "user", "content": question}], max_tokens=max_tokens):
        completion.add(response)
        print(response.text, end="", flush=True)
    usage = completion.usage
    decode = list(usage.modes[len(usage.modes) - (usage.output_tokens - 1):]) if usage.output_tokens > 1 else []
    print(f"\n\n   {usage.prompt_tokens} prompt + {usage.output_tokens} output tokens, "
          f"TTFT {usage.ttft_seconds * 1e3:.0f} ms, {usage.e2e_seconds:.1f} s in all")
    print(f"   steps: {_runs(usage.modes)}  (prefill, then one decode step per further token: {_runs(decode)})")
    return decode


async def _burst(server: str, max_tokens: int):
    from shiftjax.serving.client.grpc_client import AsyncClient

    async with AsyncClient(server, timeout=300.0) as client:
        async def one(i, prompt):
            completion = await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True)
            usage = completion.usage
            text = " ".join(completion.text.split())
            print(f"   [{i}] {prompt}{'' if text.startswith(('.', ',')) else ' '}{text[:70]}...\n"
                  f"       steps: {_runs(usage.modes)}; TTFT {usage.ttft_seconds * 1e3:.0f} ms", flush=True)
            return completion

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(BURST_PROMPTS)))


def burst(client, server: str, max_tokens: int) -> dict[str, int]:
    """Sends the burst concurrently, printing each answer as it completes; returns the
    server's steps by mode during the burst (from ServerInfo before and after)."""
    print(f"\n== a burst of {len(BURST_PROMPTS)} concurrent requests, {max_tokens} tokens each\n", flush=True)
    before = dict(client.info().steps_by_mode)
    started = time.monotonic()
    completions = asyncio.run(_burst(server, max_tokens))
    after = dict(client.info().steps_by_mode)
    steps = {mode: after.get(mode, 0) - before.get(mode, 0) for mode in after}
    tokens = sum(c.usage.output_tokens for c in completions)
    print(f"\n   {tokens} tokens in {time.monotonic() - started:.1f} s; the server ran "
          + ", ".join(f"{n} {mode.upper()} steps" for mode, n in sorted(steps.items())))
    return steps


def scrape(metrics_port: int) -> dict[tuple[str, tuple], float]:
    """The server's Prometheus samples, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def print_metrics(samples: dict) -> None:
    def value(name, **labels):
        return samples.get((f"shiftjax_{name}", tuple(sorted(labels.items()))), 0.0)

    print("\n== metrics (scraped from /metrics)\n")
    count, total = value("time_to_first_token_seconds_count"), value("time_to_first_token_seconds_sum")
    print(f"   shiftjax_time_to_first_token_seconds: {int(count)} requests, mean {total / max(count, 1) * 1e3:.0f} ms")
    for mode in ("tp", "sp"):
        steps = value("steps_total", mode=mode)
        seconds = value("step_duration_seconds_sum", mode=mode)
        print(f"   shiftjax_steps_total{{mode=\"{mode}\"}}: {int(steps)}  "
              f"(mean step {seconds / max(steps, 1) * 1e3:.0f} ms, "
              f"{int(value('step_tokens_total', mode=mode))} tokens)")
    print(f"   shiftjax_mode_switches_total: {int(value('mode_switches_total'))}")
    print(f"   shiftjax_generation_tokens_total: {int(value('generation_tokens_total'))}")
    print(f"   shiftjax_startup_compilation_cache_hits: {int(value('startup_compilation_cache_hits'))} of "
          f"{int(value('startup_executables'))} executables")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shiftjax.serving.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("serve_args", nargs="*", help="more `shiftjax serve` options (after --)")
    args = parser.parse_args(argv)
    from shiftjax.serving.bench.server_process import free_port
    from shiftjax.serving.client.grpc_client import Client

    started = time.monotonic()
    grpc_port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{grpc_port}"
    server = Server(grpc_port, metrics_port, args.serve_args)
    failures = []
    try:
        with Client(address, timeout=300.0) as client:
            server.wait_until_serving(client, args.startup_timeout)
            server.quiet = True
            print(f"\nserver SERVING on {address} after {time.monotonic() - started:.0f} s", flush=True)
            decode = single_request(client, args.max_tokens)
            if not decode or set(decode) != {"tp"}:
                failures.append(f"the single request's decode steps ran {_runs(decode)}, expected TP only")
            steps = burst(client, address, args.max_tokens)
            if steps.get("sp", 0) <= steps.get("tp", 0):
                failures.append(f"the burst ran {steps}, expected mostly SP steps")
            print_metrics(scrape(metrics_port))
        print("\n== SIGTERM: the server drains and exits", flush=True)
        server.quiet = False
        status = server.stop(timeout=60)
        if status != 0:
            failures.append(f"shiftjax serve exited with status {status} after SIGTERM, expected 0")
        else:
            print("   shiftjax serve exited 0")
    except BaseException:
        server.kill()
        raise
    for failure in failures:
        print(f"demo check failed: {failure}", file=sys.stderr)
    print(f"\ndemo {'failed' if failures else 'done'} in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
