"""Hypothesis strategies for GenerateRequests that are malformed or out of range, with an
oracle written from the documented rules (not from the server's code): which fields a
request gets wrong. A request the oracle finds nothing wrong with must succeed.

Each request breaks at most two aspects, chosen first, so that valid requests and single
faults are common instead of every request being wrong in several ways at once.
"""

from __future__ import annotations

import time

import grpc
from hypothesis import strategies as st

from shiftjax.serving.client.grpc_client import generate_request
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

NAN, INF = float("nan"), float("inf")
MISSING = object()  # the field is left out: the server's default


def _field(name, valid, invalid):
    def request_fields(value):
        return {} if value is MISSING else {name: value}

    return [request_fields(v) for v in valid], [(request_fields(v), {name}) for v in invalid]


def aspects(vocab_size: int, max_model_len: int) -> dict[str, tuple[list[dict], list[tuple[dict, set[str]]]]]:
    """aspect -> (valid request fields, [(invalid request fields, the field names a refusal may give)])."""
    user = [{"role": "user", "content": "Hi"}]
    return {
        "prompt": ([{"prompt": "Hello"}, {"prompt_ids": [1, 2, 3]}, {"messages": user}], [
            ({}, {"prompt"}), ({"prompt": ""}, {"prompt"}),
            ({"prompt_ids": [vocab_size]}, {"prompt_ids"}), ({"prompt_ids": [5, -1]}, {"prompt_ids"}),
            ({"prompt_ids": [10**12]}, {"prompt_ids"}),
            ({"messages": [{"role": "", "content": "Hi"}]}, {"messages.0.role"}),
            ({"messages": [{"role": "tool", "content": "Hi"}]}, {"messages.0.role"}),
            ({"prompt": "Hi", "prompt_ids": [1]}, {"prompt_ids"}),  # two prompts: the second is named
            ({"prompt_ids": [1], "messages": user}, {"messages"}),
        ]),
        # valid lengths are small so that valid requests really run; max_model_len leaves no room for a prompt
        "max_tokens": _field("max_tokens", [1, 3], [0, -2, max_model_len]),
        "temperature": _field("temperature", [MISSING, 0.0, 0.8], [-0.5, NAN, INF]),
        "top_p": _field("top_p", [MISSING, 0.5, 1.0], [0.0, -0.1, 1.5, NAN]),
        "top_k": _field("top_k", [MISSING, 0, 5, -1], [-2]),  # -1: vLLM's "off", as over HTTP
        "min_p": _field("min_p", [MISSING, 0.1], [-0.2, 1.5]),
        "seed": _field("seed", [MISSING, 7], [-1, 2**31]),
        "n": _field("n", [MISSING, 1], [2, 0, -1]),
        "stop": _field("stop", [[], ["\n\n"]], [[""], ["x"] * 17]),
        "stop_token_ids": _field("stop_token_ids", [[], [2]], [[-1]]),
        "logprobs": ([{"logprobs": False}, {"logprobs": True, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 20}],
                     [({"logprobs": True, "top_logprobs": 21}, {"top_logprobs"}),
                      ({"logprobs": True, "top_logprobs": -1}, {"top_logprobs"}),
                      ({"logprobs": False, "top_logprobs": 1}, {"top_logprobs"})]),
        # malformed constraints only: refused before the service compiles (a fake has no compiler)
        "structured_outputs": ([{}], [
            ({"structured_outputs": pb.StructuredOutputs()}, {"structured_outputs"}),
            ({"structured_outputs": pb.StructuredOutputs(json_schema="{")}, {"structured_outputs.json_schema"}),
            ({"structured_outputs": pb.StructuredOutputs(json_object=False)}, {"structured_outputs.json_object"}),
            ({"structured_outputs": pb.StructuredOutputs(regex="")}, {"structured_outputs.regex"}),
            ({"structured_outputs": pb.StructuredOutputs(choice=pb.ChoiceList())}, {"structured_outputs.choice"}),
        ]),
    }


@st.composite
def generate_requests(draw, vocab_size: int, max_model_len: int):
    """(GenerateRequest, the field names a refusal may give; empty when it is valid)."""
    table = aspects(vocab_size, max_model_len)
    broken = draw(st.sets(st.sampled_from(sorted(table)), max_size=2))
    fields, wrong = {}, set()
    for aspect, (valid, invalid) in table.items():
        if aspect in broken:
            request_fields, names = draw(st.sampled_from(invalid))
            fields.update(request_fields)
            wrong |= names
        else:
            fields.update(draw(st.sampled_from(valid)))
    return generate_request(**fields), wrong


def check_one_request(client, case, pages_all_free):
    """A request the oracle finds wrong gets INVALID_ARGUMENT naming one of its wrong fields;
    a right one streams to a finish; either way a good request succeeds right after, and
    every page is free again."""
    request, wrong = case
    try:
        responses = list(client.stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert wrong, f"a valid request was refused: {error.code()} {error.details()}"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error.details().split(":")[0] in wrong, (error.details(), wrong)
    else:
        assert not wrong, f"accepted a request wrong in {wrong}"
        assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert responses[-1].usage.output_tokens == sum(len(r.token_ids) for r in responses) <= request.max_tokens
    assert client.complete(prompt_ids=[1, 2], max_tokens=1).finish_reason is not None
    give_up = time.monotonic() + 5
    while not pages_all_free():
        assert time.monotonic() < give_up, "pages leaked"
        time.sleep(0.01)
    return "refused" if wrong else "valid"
