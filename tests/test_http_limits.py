"""The HTTP front end against what a hostile client sends, on the fake service and
a real uvicorn on loopback: bodies past the size limit (413, by Content-Length and while
streaming), bodies and headers sent too slowly (408; the connection closed), JSON too deep
or not Unicode (400 naming where), a client leaving mid-body (one debug line), when to
retry (429 and 503 carry Retry-After, /health too while draining), and TLS with the
certificate options gRPC takes."""

import json
import logging
import socket
import ssl
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from grpc_harness import self_signed_certificate
from http_fake_service import FakeService
from http_live_server import live_server
from shiftjax.serving.server.body_limits import HttpLimits
from shiftjax.serving.server.http_server import create_app

LIMITS = HttpLimits(max_request_bytes=64 * 1024, read_timeout_seconds=0.5)
GOOD = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def service():
    return FakeService()


@pytest.fixture(scope="module")
def url(service):
    with live_server(create_app(service, model_name="fake-model", limits=LIMITS)) as base:
        yield base


def raw_exchange(url: str, data: bytes, wait: float = 0.0) -> bytes:
    """Sends ``data`` on a fresh connection, waits ``wait`` seconds, then reads what comes
    back until the server closes the connection (or 5 s pass)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        time.sleep(wait)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            answer += b"<still open>"
        return answer


def test_a_body_past_the_limit_is_413_by_its_length_or_as_it_streams(url, service):
    before = len(service.submitted)
    with httpx.Client(base_url=url, timeout=10) as http:
        too_big = json.dumps({"prompt": "x" * LIMITS.max_request_bytes}).encode()
        declared = http.post("/v1/completions", content=too_big, headers={"content-type": "application/json"})
        streamed = http.post("/v1/completions", content=iter([too_big[:40_000], too_big[40_000:]]))  # chunked
        for r in (declared, streamed):
            assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
            assert "65536" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json=GOOD).status_code == 200  # the same client goes on
    assert len(service.submitted) == before + 1


def test_a_slow_body_is_408_and_slow_headers_are_cut(url):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    started = time.monotonic()
    answer = raw_exchange(url, head + b'{"prompt": ')
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"param":"body"' in answer, answer
    assert not answer.endswith(b"<still open>")  # closed after the 408
    for partial in (b"POST /v1/completions HTT", b"GET /health HTTP/1.1\r\nHost: x\r\n", b""):
        assert raw_exchange(url, partial) == b"", partial  # closed, unanswered: no request came
    assert time.monotonic() - started < 4 * LIMITS.read_timeout_seconds + 2
    endless = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * (LIMITS.max_header_bytes + 1)
    assert raw_exchange(url, endless).startswith(b"HTTP/1.1 400 ")  # h11's limit: "Invalid HTTP request"


BAD_BODIES = [  # (body, the param the 400 names)
    (b"[" * 30_000 + b"]" * 30_000, "body"),  # was a RecursionError: a 500 and two tracebacks
    (b'{"prompt": "hi", "stop": ' + b"[" * 40 + b"]" * 40 + b"}", "body"),
    (b'{"prompt": "hi \xff"}', "body"),  # not UTF-8
    (b'{"prompt": "hi \\ud800"}', "prompt"),  # a lone surrogate
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop.0"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "body"),  # past Python's 4,300 digits
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),  # infinity
    (b'{"prompt": "hi", "seed": 100000000000000000000000000000}', "seed"),
    (b'{"prompt": "hi", "\\u001b[2J' + b"k" * 500 + b'": 1}', "'\\x1b[2J" + "k" * 32 + "... (504 characters)"),
    (b"5", "body"), (b"", "body"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_deep_wide_and_broken_json_is_400_naming_where(url, body, param):
    with httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert len(r.text) < 1000  # nothing the client sent is echoed whole
        assert http.post("/v1/completions", json=GOOD).status_code == 200  # the connection is kept


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_leaving_mid_body_is_one_debug_line(url):
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("shiftjax", "uvicorn", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(records)
        logger.setLevel(logging.DEBUG)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        for _ in range(3):
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(head + b'{"prompt": "')
                time.sleep(0.05)  # the body's first bytes are read, then the client goes
        time.sleep(0.3)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(records)
            logger.setLevel(level)
    left = [r for r in records.records if "the client left" in r.getMessage()]
    assert len(left) == 3 and all(r.levelno == logging.DEBUG and r.exc_info is None for r in left), left
    assert not [r for r in records.records if r.levelno >= logging.WARNING], [r.getMessage() for r in records.records]


def test_429_and_503_say_when_to_retry():
    service = FakeService()
    with TestClient(create_app(service, model_name="fake-model")) as client:
        service.capacity = 0
        r = client.post("/v1/completions", json=GOOD)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        service.capacity, service.draining = None, True
        for r in (client.post("/v1/completions", json=GOOD), client.get("/health")):
            assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
        assert client.get("/health").json() == {"status": "draining"}
        service.draining, service.ready = False, False
        assert client.get("/health").headers["retry-after"] and client.get("/health").json() == {"status": "starting"}
    assert not service.submitted  # refused before anything was queued


def test_https_with_the_grpc_certificate_options(tmp_path, service):
    """serve's --tls-cert/--tls-key put the HTTP port on TLS too: the bearer token no longer
    travels in clear there."""
    self_signed_certificate(tmp_path)
    files = (tmp_path / "cert.pem", tmp_path / "key.pem")
    app = create_app(service, model_name="fake-model", api_key="s3cret")
    with live_server(app, tls_files=files) as base:
        assert base.startswith("https://")
        headers = {"Authorization": "Bearer s3cret"}
        trusted = ssl.create_default_context(cafile=str(files[0]))
        with httpx.Client(base_url=base, verify=trusted, timeout=10) as https:
            assert https.post("/v1/completions", json=GOOD, headers=headers).json()["choices"][0]["text"] == "He"
        with pytest.raises(httpx.HTTPError):  # no plaintext on the TLS port
            httpx.get(base.replace("https://", "http://") + "/health", timeout=5)
