"""Issue 31's attacks on ``shiftjax serve``, scripted: what a cheap hostile client sends, and
how every one of them was answered.

Starts ``shiftjax serve`` on the default model (a 2x2 CPU mesh, short buckets) with the
HTTP and metrics ports, a bearer token and a short grace, then:

- ``http_bodies``: malformed OpenAI bodies (deep, wide, wrong types, huge numbers, invalid
  UTF-8, lone surrogates, not JSON); every answer must be a 2xx or a 4xx naming a param;
- ``grpc_requests``: GenerateRequests with random field values, and bytes that are none;
  every answer OK, INVALID_ARGUMENT naming a field, or RESOURCE_EXHAUSTED;
- ``greedy``: the same greedy request before and after those two, token for token;
- ``big_prompts``: 20 MB over HTTP and gRPC and 2.7 MB over HTTP while /health is polled
  and a stream runs (health's worst latency; the stream's tokens meanwhile);
- ``slow_clients``: connections that send half a request line, headers then half a body
  then leave, or a body that never ends (how long each is held; log lines they cause);
- ``id_stealing``: streams opened as ``req-0`` ... ``req-7``, then ordinary requests;
- ``queue``: 40 clients at once against ``--max-queue 4`` (429s and their Retry-After);
- ``auth``: one set of Authorization headers to both front ends (the same verdicts);
- ``metrics_port``: paths other than /metrics;
- ``sigterm``: SIGTERM under load (SSE and gRPC streams): /health during the drain, each
  stream's end, the exit status.

    .venv/bin/python benchmarks/hostile_clients.py [--smoke] [--out DIR]

Prints one JSON object: per attack, what was sent and how it was answered. The server's
stderr is scanned for tracebacks and ERROR lines.

Results (2026-12-01, this 2-core CPU shared with other sessions, load average 4-5; the
tree of issue 31's fixes): 225 bad HTTP bodies answered 200 x7, 400 x199, 404 x1 (an
unknown model), 413 x18, no 5xx, every 400 and 413 naming its param; 100 bad gRPC requests
INVALID_ARGUMENT x92 (each naming a field, or ``request`` for bytes that are no message),
OK x8, no INTERNAL or UNKNOWN; greedy tokens unchanged afterwards; 20 MB: 413 and
RESOURCE_EXHAUSTED at once, 2.7 MB: 400 after 2.4 s of tokenizing, health's worst latency
meanwhile 0.08 s (0.02 s with no attack) and the running stream went on; 3 x 100 slow
connections each closed after 2.0 s (``--read-timeout 2``), 100 clients gone mid-body: no
log line; 4 streams opened as req-0 .. req-3, then 4 ordinary requests: none failed; 40
clients against ``--max-queue 4``: 5 served, 35 429s with ``Retry-After: 1``; 7
Authorization headers, the same verdict from both front ends; the metrics port 404 off
/metrics; SIGTERM under 8 streams (4 running, 4 queued): /health 503 with Retry-After 5,
4 SSE streams ``abort`` then ``[DONE]``, 4 gRPC ``FINISH_REASON_ABORT``, exit 0; no
traceback or ERROR line in the server's log. Before the fixes (issue 31): nested JSON a
500 with two tracebacks, 16 s health stalls under a 20 MB prompt, ids stolen, SSE cut
with a protocol error at the end of the grace.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx

from shiftjax.serving.client.grpc_client import Client, generate_request
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

ENGINE_ARGS = ["--cpu-devices", "4", "--sp", "2", "--tp", "2", "--max-model-len", "128", "--num-pages", "64",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "16,64",
               "--seq-buckets", "4", "--shift-threshold", "32", "--max-queue", "4", "--grace-seconds", "3"]
TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serve:
    """``shiftjax serve`` as a subprocess, its stderr kept line by line."""

    def __init__(self, key_file: Path):
        self.http_port, self.metrics_port = free_port(), free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shiftjax.serving.cli", "serve", *ENGINE_ARGS, "--port", "0", "--http-port",
             str(self.http_port), "--metrics-port", str(self.metrics_port), "--api-key-file", str(key_file),
             "--read-timeout", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(line.rstrip("\n") for line in self.process.stderr),
                         daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.address = self._wait_for(r"serving gRPC on (\S+)", 600).group(1)

    def _wait_for(self, pattern: str, seconds: float):
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up and self.process.poll() is None:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.1)
        raise RuntimeError("serve did not start:\n" + "\n".join(self.lines))

    def bad_lines(self, since: int = 0) -> dict:
        lines = self.lines[since:]
        return {"traceback_lines": sum("Traceback" in line for line in lines),
                "error_lines": sum(" ERROR " in line or " CRITICAL " in line for line in lines),
                "log_lines": len(lines)}


# --- HTTP bodies -------------------------------------------------------------------

def http_bodies(rng: random.Random, count: int) -> list[bytes]:
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
              "logprobs", "top_logprobs", "stop_token_ids", "stream", "cache_salt", "logit_bias", "model", "tools"]
    junk = [None, True, -1, 0, 2**63, 10**100, 1e308, -0.5, "", "x" * 50, [], {}, [[["deep"]]], {"a": {"b": 1}},
            [1, "two", None], "\u202e\u0000"]

    def near_valid():
        body = {"prompt": "Hi", "max_tokens": 2} if rng.random() < 0.5 else \
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for _ in range(rng.randint(0, 2)):  # none: a valid request among the rest
            body[rng.choice(fields)] = rng.choice(junk)
        if body.get("max_tokens") is None or isinstance(body["max_tokens"], int) and 2 < body["max_tokens"] < 10**6:
            body["max_tokens"] = 2  # valid ones stay cheap on a CPU
        return json.dumps(body).encode()

    kinds = [
        near_valid, near_valid, near_valid,
        lambda: b"[" * rng.choice([100, 1000, 100_000]) + b"]" * 100,
        lambda: b'{"prompt": "Hi", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        lambda: json.dumps({"prompt": list(range(rng.choice([1000, 300_000])))}).encode(),
        lambda: json.dumps({"prompt": "Hi", "stop": ["x"] * 10_000}).encode(),
        lambda: json.dumps({"prompt": "Hi", **{f"k{i}": i for i in range(2000)}}).encode(),
        lambda: b'{"prompt": "Hi", "max_tokens": 1' + b"0" * rng.choice([30, 5000]) + b"}",
        lambda: b'{"prompt": "Hi", "temperature": ' + rng.choice([b"1e400", b"NaN", b"-Infinity"]) + b"}",
        lambda: b'{"prompt": "Hi ' + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800"]) + b'"}',
        lambda: rng.choice([b"", b"null", b"[]", b"5", b"{", b'{"prompt": "Hi",}']),
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
        lambda: json.dumps({"prompt": "x " * 3_000_000}).encode(),  # 6 MB: past the 4 MiB limit
    ]
    return [rng.choice(kinds)() for _ in range(count)]


def attack_http_bodies(serve: Serve, rng: random.Random, count: int) -> dict:
    answers, unnamed, paths = Counter(), 0, ["/v1/completions", "/v1/chat/completions"]
    with httpx.Client(base_url=serve.url, headers=AUTH, timeout=120) as http:
        for i, body in enumerate(http_bodies(rng, count)):
            r = http.post(paths[i % 2], content=body, headers={"content-type": "application/json"})
            answers[r.status_code] += 1
            if r.status_code in (400, 413) and not (r.json()["error"].get("param") or ""):
                unnamed += 1
    return {"sent": count, "answers": dict(sorted(answers.items())), "4xx_without_param": unnamed,
            "5xx": sum(n for status, n in answers.items() if status >= 500)}


# --- gRPC requests -----------------------------------------------------------------

def grpc_messages(rng: random.Random, count: int) -> list[bytes]:
    values = {"max_tokens": [0, -1, 2, 2**31 - 1], "temperature": [float("nan"), float("inf"), -1.0, 0.0, 0.7],
              "top_p": [0.0, 1.5, float("nan"), 0.9], "top_k": [-2, -1, 0, 5, 2**31 - 1], "min_p": [-0.1, 2.0, 0.1],
              "seed": [-1, 2**63 - 1, 7], "n": [0, 2, 1], "top_logprobs": [-1, 21, 3],
              "request_id": ["", "ok", "x" * 100_000, "\x1b[2J\x07", "é"], "cache_salt": ["", "s", "\x00"],
              "prompt": ["", "Hi", "x" * 50_000]}
    out = []
    for _ in range(count):
        if rng.random() < 0.15:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 40))))
            continue
        request = pb.GenerateRequest(prompt="Hi", max_tokens=2)
        for name in rng.sample(sorted(values), rng.randint(1, 3)):
            setattr(request, name, rng.choice(values[name]))
        if rng.random() < 0.2:
            request.prompt_ids.extend(rng.choice([[1, 2], [-5], [2**62], [49152]]))
        if rng.random() < 0.2:
            request.ClearField("prompt")
            request.messages.add(role=rng.choice(["user", "tool", "", "wizard"]), content="Hi")
        if 2 < request.max_tokens < 10**6:
            request.max_tokens = 2
        out.append(request.SerializeToString())
    return out


def attack_grpc_requests(serve: Serve, rng: random.Random, count: int) -> dict:
    answers, unnamed = Counter(), 0
    with grpc.insecure_channel(serve.address) as channel:
        generate = channel.unary_stream("/shiftjax.v1.InferenceService/Generate")
        for raw in grpc_messages(rng, count):
            try:
                list(generate(raw, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=120))
                answers["OK"] += 1
            except grpc.RpcError as error:
                answers[error.code().name] += 1
                field = error.details().split(":")[0].split(".")[0]
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT and not re.fullmatch(r"[a-z_]+", field):
                    unnamed += 1
    bad = sum(answers[name] for name in ("INTERNAL", "UNKNOWN"))
    return {"sent": count, "answers": dict(sorted(answers.items())), "invalid_argument_without_field": unnamed,
            "internal_or_unknown": bad}


def greedy(client: Client) -> list[int]:
    return list(client.complete("The capital of France is", max_tokens=8).token_ids)


# --- the event loop under big prompts ----------------------------------------------

def attack_big_prompts(serve: Serve, client: Client) -> dict:
    words = ["shift", "parallel", "tensor", "sequence", "cache", "page", "token", "step"]
    prompt = " ".join(random.Random(0).choice(words) for _ in range(450_000))
    arrivals, answers, done = [], {}, threading.Event()
    stream = client.stub.Generate(generate_request(prompt_ids=[1, 2, 3], max_tokens=100, ignore_eos=True),
                                  metadata=[("authorization", f"Bearer {TOKEN}")])
    def read():
        try:
            arrivals.extend(time.monotonic() for _ in stream)
        except grpc.RpcError:  # cancelled once the attack is over
            pass

    threading.Thread(target=read, daemon=True).start()
    time.sleep(1.0)

    def attack():
        started = time.monotonic()
        with httpx.Client(base_url=serve.url, headers=AUTH, timeout=300) as http:
            answers["http_20MB"] = http.post("/v1/completions", json={"prompt": "x " * 10_000_000}).status_code
            answers["http_2.7MB"] = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code
        try:
            list(client.generate("x " * 10_000_000, max_tokens=2))
        except grpc.RpcError as error:
            answers["grpc_20MB"] = error.code().name
        answers["seconds"] = round(time.monotonic() - started, 2)
        done.set()

    def poll(until) -> list[float]:
        latencies = []
        with httpx.Client(base_url=serve.url, timeout=60) as http:
            while not until():
                sent = time.monotonic()
                http.get("/health")
                client.health()
                latencies.append(time.monotonic() - sent)
                time.sleep(0.05)
        return latencies

    quiet_until = time.monotonic() + 3.0
    quiet = poll(lambda: time.monotonic() > quiet_until)  # the same polling, no attack: this CPU's own noise
    started = time.monotonic()
    threading.Thread(target=attack, daemon=True).start()
    attacked = poll(done.is_set)
    ended = time.monotonic()
    stream.cancel()
    return answers | {"health_checks": len(attacked), "health_worst_seconds": round(max(attacked), 3),
                      "health_worst_seconds_without_attack": round(max(quiet), 3),
                      "stream_tokens_meanwhile": sum(started <= t <= ended for t in arrivals)}


# --- slow and vanishing clients ------------------------------------------------------

def attack_slow_clients(serve: Serve, count: int) -> dict:
    before = len(serve.lines)
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n")
    kinds = {"half_request_line": b"POST /v1/compl", "headers_no_end": b"GET /health HTTP/1.1\r\nHost: x\r\n",
             "half_body_then_wait": post + b"\r\n" + b'{"prompt": "'}
    held = {}
    for name, data in kinds.items():
        socks = [socket.create_connection(("127.0.0.1", serve.http_port)) for _ in range(count)]
        started = time.monotonic()
        for sock in socks:
            sock.sendall(data)
            sock.settimeout(30)
        closed = []
        for sock in socks:
            while sock.recv(65536):  # a 408 comes first for a body: read on to the close
                pass
            closed.append(time.monotonic() - started)
        held[name] = round(max(closed), 2)
        for sock in socks:
            sock.close()
    for _ in range(count):  # headers and part of a body, then gone
        with socket.create_connection(("127.0.0.1", serve.http_port)) as sock:
            sock.sendall(post + b"\r\n" + b'{"prompt": "')
            time.sleep(0.01)
    time.sleep(1.0)
    return {"connections_per_kind": count, "held_seconds_at_most": held, "vanishing_clients": count,
            **serve.bad_lines(before)}


# --- ids, the queue, auth, the metrics port ------------------------------------------

def attack_id_stealing(client: Client) -> dict:
    thieves = [client.generate(prompt_ids=[9, 9], max_tokens=6, ignore_eos=True, request_id=f"req-{i}") for i in range(4)]
    firsts = [next(t) for t in thieves]
    failures, ids = 0, []
    for _ in range(4):
        try:
            ids.append(client.complete(prompt_ids=[7, 7], max_tokens=2).request_id)
        except grpc.RpcError:
            failures += 1
    thieves_ok = sum(1 for f, t in zip(firsts, thieves) if (list(t) or [f])[-1].finish_reason)
    return {"thief_streams": 4, "thieves_served": thieves_ok, "ordinary_requests": 4, "ordinary_failed": failures,
            "server_ids": ids[:2]}


def attack_queue(serve: Serve, clients: int) -> dict:
    answers, retry_after = Counter(), Counter()

    def one(i):
        body = {"prompt": f"#{i}", "max_tokens": 16, "ignore_eos": True}
        r = httpx.post(f"{serve.url}/v1/completions", json=body, headers=AUTH, timeout=300)
        answers[r.status_code] += 1
        if r.status_code == 429:
            retry_after[r.headers.get("retry-after", "none")] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"clients": clients, "answers": dict(answers), "retry_after_on_429": dict(retry_after)}


def attack_auth(serve: Serve) -> dict:
    headers = [None, f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN}", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
               f"Bearer{TOKEN}"]
    verdicts = {}
    with grpc.insecure_channel(serve.address) as channel:
        info = channel.unary_unary("/shiftjax.v1.InferenceService/ServerInfo")
        for header in headers:
            r = httpx.get(f"{serve.url}/v1/models", headers={"Authorization": header} if header else {}, timeout=30)
            try:
                info(pb.ServerInfoRequest().SerializeToString(),
                     metadata=[("authorization", header)] if header else [], timeout=30)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            verdicts[repr(header)] = (r.status_code, code)
    agree = all((status == 200) == (code == "OK") for status, code in verdicts.values())
    return {"verdicts": verdicts, "front_ends_agree": agree}


def attack_metrics_port(serve: Serve) -> dict:
    base = f"http://127.0.0.1:{serve.metrics_port}"
    return {path: httpx.get(base + path, timeout=30).status_code for path in ("/metrics", "/", "/admin", "/metricsx")}


# --- SIGTERM under load --------------------------------------------------------------

def attack_sigterm(serve: Serve, client: Client, streams: int) -> dict:
    ends = []

    def sse():
        body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{serve.url}/v1/completions", json=body, headers=AUTH, timeout=300) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            if r.status_code != 200:  # refused before it streamed (the queue is full)
                ends.append(f"sse {r.status_code}")
                return
            last = json.loads(lines[-2][6:]) if len(lines) > 1 else {}
            reason = (last.get("choices") or [{}])[0].get("finish_reason") or last.get("error", {}).get("code")
            ends.append(f"sse {r.status_code} {reason} {'[DONE]' if lines[-1] == 'data: [DONE]' else 'no [DONE]'}")
        except Exception as error:  # noqa: BLE001
            ends.append(f"sse protocol error {type(error).__name__}")

    def over_grpc():
        try:
            responses = list(client.generate(prompt_ids=[5, 6], max_tokens=100, ignore_eos=True))
            ends.append(f"grpc {pb.FinishReason.Name(responses[-1].finish_reason)}")
        except grpc.RpcError as error:
            ends.append(f"grpc error {error.code().name}")

    threads = [threading.Thread(target=sse if i % 2 else over_grpc) for i in range(streams)]
    for i, thread in enumerate(threads):  # the first half running before the rest queue (--max-queue 4)
        thread.start()
        time.sleep(1.5 if i + 1 == streams // 2 else 0.0)
    time.sleep(1.5)
    serve.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    health = httpx.get(f"{serve.url}/health", timeout=30)
    for thread in threads:
        thread.join(120)
    code = serve.process.wait(120)
    return {"streams": streams, "health_during_drain": [health.status_code, health.headers.get("retry-after")],
            "stream_ends": dict(Counter(ends)), "exit_status": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a few of each attack, without the big prompts and the slow clients (tests/"
                             "test_grpc_default_model.py and test_http_limits.py take those)")
    parser.add_argument("--out", type=Path, default=None, help="a directory: hostile_clients.json goes there too")
    args = parser.parse_args()
    rng = random.Random(31)
    scale = (dict(bodies=12, grpc=8, slow=0, queue=6, sigterm=2) if args.smoke
             else dict(bodies=225, grpc=100, slow=100, queue=40, sigterm=8))  # 8: 4 running, 4 queued
    if args.smoke:  # its requests hold at most ~22 pages at once; the later --num-pages wins. (The CPU's
        # layer scan carries the whole cache each step: 64 pages made each step ~2x slower than 24.)
        ENGINE_ARGS.extend(["--num-pages", "24"])
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "token"
        key_file.write_text(TOKEN)
        serve = Serve(key_file)
        results = {}
        try:
            with Client(serve.address, api_key=TOKEN, timeout=300) as client:
                before = greedy(client)
                results["http_bodies"] = attack_http_bodies(serve, rng, scale["bodies"])
                results["grpc_requests"] = attack_grpc_requests(serve, rng, scale["grpc"])
                results["greedy_unchanged"] = greedy(client) == before
                if not args.smoke:
                    results["big_prompts"] = attack_big_prompts(serve, client)
                    results["slow_clients"] = attack_slow_clients(serve, scale["slow"])
                results["id_stealing"] = attack_id_stealing(client)
                results["queue"] = attack_queue(serve, scale["queue"])
                results["auth"] = attack_auth(serve)
                results["metrics_port"] = attack_metrics_port(serve)
                results["sigterm"] = attack_sigterm(serve, client, scale["sigterm"])
            results["server_log"] = serve.bad_lines()
        finally:
            if serve.process.poll() is None:
                serve.process.kill()
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hostile_clients.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
