"""Hypothesis strategies for what a hostile client sends, and the oracle every
answer must meet: raw HTTP bodies (deep, wide, wrong types, huge numbers, invalid UTF-8,
lone surrogates, not JSON at all) and GenerateRequests with any field values, or bytes
that are no request. Every answer is a 2xx, or a 4xx naming what is wrong; never a 5xx
(HTTP), INTERNAL or UNKNOWN (gRPC).

Valid requests are kept cheap on a CPU engine: any ``max_tokens`` a request would run
with is cut to :data:`CHEAP_TOKENS` (a value the engine refuses stays as it is).
"""

from __future__ import annotations

import json
import re

import grpc
from hypothesis import strategies as st

from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

CHEAP_TOKENS = 2
_COSTLY = ("max_tokens", "max_completion_tokens")

# --- HTTP ---------------------------------------------------------------------------

huge_ints = st.sampled_from([10**18, 2**63, -(2**63) - 1, 10**100, 2**31, -1])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), huge_ints,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
COMPLETION = {"prompt": "Hi", "max_tokens": CHEAP_TOKENS, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": CHEAP_TOKENS, "temperature": 0}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "stop_token_ids",
          "ignore_eos", "cache_salt", "logit_bias", "user", "echo", "response_format", "tools"]


def _cheap(body):
    if isinstance(body, dict):
        for key in _COSTLY:
            value = body.get(key, 0)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and CHEAP_TOKENS < value < 10**6):
                body[key] = CHEAP_TOKENS
    return body


def _dumps(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def near_valid_bodies(draw) -> bytes:
    """A valid body with one to three fields set to anything, or an unknown field added."""
    body = json.loads(json.dumps(draw(st.sampled_from([COMPLETION, CHAT]))))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)))
        body[key] = draw(json_values)
    return _dumps(_cheap(body))


def _nested(depth: int, where: str) -> bytes:
    deep = "[" * depth + "]" * depth
    return {"bare": deep, "stop": '{"prompt": "Hi", "stop": %s}' % deep,
            "content": '{"messages": [{"role": "user", "content": %s}]}' % deep}[where].encode()


def _with_bytes(raw: bytes) -> bytes:
    """A completion body whose prompt holds ``raw`` (invalid UTF-8, or an encoded surrogate)."""
    return b'{"prompt": "Hi ' + raw + b'", "max_tokens": 2}'


hostile_bodies = st.one_of(
    near_valid_bodies(),
    st.builds(_nested, st.sampled_from([40, 1_000, 100_000]), st.sampled_from(["bare", "stop", "content"])),
    st.sampled_from([  # wide
        _dumps({"prompt": list(range(200_000)), "max_tokens": 2}),
        _dumps({"prompt": ["a"] * 300, "max_tokens": 2}),
        _dumps({"prompt": "Hi", "stop": ["x"] * 10_000}),
        _dumps({"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(5_000)}}),
        _dumps({"prompt": "Hi", **{f"k{i}": i for i in range(3_000)}}),
        _dumps({"prompt": "Hi", "max_tokens": 2, "stop_token_ids": list(range(50_000))}),
    ]),
    st.sampled_from([  # huge numbers
        b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "Hi", "temperature": 1e400}',
        b'{"prompt": "Hi", "seed": -1e400}', b'{"prompt": [1' + b"0" * 30 + b"]}",
        b'{"prompt": "Hi", "top_p": NaN}', b'{"prompt": "Hi", "max_tokens": 2.0}',
    ]),
    st.builds(_with_bytes, st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"\\udfff x", b"\x00"])),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"5", b"{", b'{"prompt": "Hi",}', b"\xef\xbb\xbf{}"]),
    st.binary(max_size=64),
)

_FIELD = re.compile(r"^[\w.']")


def _top_keys(body: bytes) -> set:
    try:
        parsed = json.loads(body)
    except ValueError:
        return set()
    return set(parsed) if isinstance(parsed, dict) else set()


def check_http_answer(status: int, content_type: str, text: str, body: bytes) -> str:
    """The oracle: 200 (a stream ending in ``[DONE]`` with no error event) or a 4xx whose
    error names a parameter (every 400 and 413 do); returns "ok" or "refused"."""
    assert status < 500, (status, text[:500], body[:200])
    if status == 200:
        if content_type.startswith("text/event-stream"):
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
            assert '"error"' not in text, text[-500:]
        return "ok"
    error = json.loads(text)["error"]
    assert error["message"] and error["type"], text
    if status in (400, 413):
        # a field name, or a key the client sent as it sent it (an unknown parameter named ":")
        assert isinstance(error["param"], str) and (_FIELD.match(error["param"]) or error["param"] in _top_keys(body)), \
            (text, body[:200])
    return "refused"


# --- gRPC ---------------------------------------------------------------------------

int32s = st.one_of(st.integers(-3, 300), st.sampled_from([2**31 - 1, -(2**31)]))
int64s = st.one_of(st.integers(-3, 50_000), st.sampled_from([2**63 - 1, -(2**63), 2**31]))
float32s = st.floats(width=32, allow_nan=True, allow_infinity=True)
texts = st.one_of(st.text(max_size=20), st.sampled_from(["", "x" * 20_000, "\x1b[2J\x07", "\u202e\ufeff"]))
messages = st.lists(st.builds(lambda role, content: {"role": role, "content": content},
                              st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]),
                                        st.text(max_size=6)), texts), max_size=3)


_SCALARS = {"max_tokens": int32s, "temperature": float32s, "top_p": float32s, "top_k": int32s, "min_p": float32s,
            "seed": int64s, "n": int32s, "top_logprobs": int32s, "ignore_eos": st.booleans(),
            "logprobs": st.booleans(), "request_id": texts, "cache_salt": texts, "prompt": texts}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A valid GenerateRequest with one to three fields set to anything (a scalar, or the
    prompt ids, messages, stop strings or stop token ids), so that both valid requests and
    single faults are common."""
    request = pb.GenerateRequest(prompt="Hi", max_tokens=CHEAP_TOKENS)
    for field in draw(st.lists(st.sampled_from([*_SCALARS, "prompt_ids", "messages", "stop", "stop_token_ids"]),
                               min_size=1, max_size=3)):
        if field in _SCALARS:
            setattr(request, field, draw(_SCALARS[field]))
        elif field == "messages":
            request.ClearField("prompt")
            for message in draw(messages):
                request.messages.add(**message)
        else:
            if field == "prompt_ids" and draw(st.booleans()):
                request.ClearField("prompt")  # else two prompts: refused
            getattr(request, field).extend(draw(st.lists(st.text(max_size=4) if field == "stop" else int64s,
                                                         max_size=4)))
    if CHEAP_TOKENS < request.max_tokens < 10**6:
        request.max_tokens = CHEAP_TOKENS
    return request


hostile_messages = st.one_of(generate_requests().map(lambda r: r.SerializeToString()), st.binary(max_size=40))
FIELD_NAMES = {field.name for field in pb.GenerateRequest.DESCRIPTOR.fields} | {"request"}
ACCEPTABLE = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def check_grpc_answer(generate, raw: bytes) -> str:
    """The oracle: OK with a finish reason at the end, INVALID_ARGUMENT naming a field of
    GenerateRequest (or ``request``), or RESOURCE_EXHAUSTED; returns "ok" or "refused"."""
    try:
        responses = list(generate(raw, timeout=120))
    except grpc.RpcError as error:
        assert error.code() in ACCEPTABLE, (error.code(), error.details(), raw[:200])
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            field = error.details().split(":")[0].split(".")[0]
            assert field in FIELD_NAMES, (error.details(), raw[:200])
        return "refused"
    assert responses and pb.GenerateResponse.FromString(responses[-1]).finish_reason, raw[:200]
    return "ok"
