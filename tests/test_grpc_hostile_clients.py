"""The gRPC front end against what a hostile client sends, on the fake service:
bytes that are no request message, a message past the size limit, request ids chosen to
collide or to carry escapes. The default model's turn (fuzzing, a 20 MB prompt, the
id-stealing sequence) is in test_grpc_default_model.py."""

import threading

import grpc
import pytest

from grpc_harness import FakeEngineService, ServerThread, expected_output, serving_client
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.tokenizer import Tokenizer
from shiftjax.serving.client.grpc_client import Client
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

LIMIT = 64 * 1024  # --max-request-bytes, small so that a test need not send megabytes


@pytest.fixture(scope="module")
def fake():
    return FakeEngineService(Tokenizer.from_dir(default_model_path()))


@pytest.fixture(scope="module")
def server(fake):
    """The fake behind a server whose message limit is :data:`LIMIT`."""
    thread = ServerThread(fake, max_message_bytes=LIMIT)
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def client(server):
    with serving_client(server.address) as c:
        yield c


def code_and_details(call, request):
    try:
        responses = call(request, timeout=30)
        if hasattr(responses, "__next__"):
            list(responses)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method, streamed", [("/shiftjax.v1.InferenceService/Generate", True),
                                              ("/shiftjax.v1.InferenceService/Tokenize", False),
                                              ("/shiftjax.v1.InferenceService/ServerInfo", False),
                                              ("/grpc.health.v1.Health/Check", False)])
def test_bytes_that_are_no_request_are_invalid_argument_naming_request(client, fake, method, streamed):
    """They were "Unexpected DecodeError", UNKNOWN, with a traceback in the log."""
    call = (client.channel.unary_stream if streamed else client.channel.unary_unary)(method)
    bad_utf8 = (b"\x0a\x02\xc3\x28",) if streamed or "Tokenize" in method else ()  # field 1 is a string there
    for raw in (b"\xff\xff\xff", b"\x12\x05ab", *bad_utf8):  # not protobuf; a field cut short; bad UTF-8
        code, details = code_and_details(call, raw)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request: "), (raw, code, details)
    assert client.complete(prompt_ids=[1], max_tokens=2).token_ids == expected_output([1], 2)
    assert fake.free_pages == fake.num_pages


def test_a_message_past_the_limit_is_resource_exhausted(client, fake):
    """The same limit as HTTP's body (--max-request-bytes), enforced by grpc before a byte is parsed."""
    generate = client.stub.Generate
    code, _ = code_and_details(generate, pb.GenerateRequest(prompt="x" * (LIMIT + 1), max_tokens=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, details = code_and_details(generate, pb.GenerateRequest(prompt_ids=[1] * 5000, max_tokens=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_tokens:")  # under the limit: read
    assert client.complete(prompt_ids=[4], max_tokens=1).finish_reason == "length"


def test_a_client_id_is_a_label_of_its_own_call_and_collides_with_no_one(server, fake):
    """Two callers choosing the same id (or the service's own form of id) both stream to
    the end, each reading its own id back; the service keys them by ids of its own."""
    results, barrier = {}, threading.Barrier(2)

    def run(name, prompt):
        with Client(server.address, timeout=30.0) as own:
            stream = own.generate(prompt_ids=prompt, max_tokens=20, request_id="fake-0")
            first = next(stream)
            barrier.wait(10)  # both in flight at once
            results[name] = [first, *stream]

    threads = [threading.Thread(target=run, args=(name, prompt)) for name, prompt in (("a", [1]), ("b", [2]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for name, prompt in (("a", [1]), ("b", [2])):
        responses = results[name]
        assert {r.request_id for r in responses} == {"fake-0"}
        assert [t for r in responses for t in r.token_ids] == expected_output(prompt, 20)
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(request.request_id is None for request in fake.submitted[-2:])  # the service chose the keys


@pytest.mark.parametrize("request_id, words", [("x" * 129, "has 129 characters; give at most 128"),
                                               ("job\x1b]0;owned\x07", "'\\x1b' at position 3"),
                                               ("tab\there", "'\\t' at position 3"), ("é", "'é' at position 0")])
def test_a_client_id_is_at_most_128_printable_ascii_characters(client, request_id, words):
    code, details = code_and_details(client.stub.Generate, pb.GenerateRequest(prompt_ids=[1], request_id=request_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id: ") and words in details
    assert len(details) < 300  # the id is not echoed whole
    ok = client.complete(prompt_ids=[1], max_tokens=1, request_id="~ printable ASCII, spaces too " + "x" * 98)
    assert ok.request_id == "~ printable ASCII, spaces too " + "x" * 98
