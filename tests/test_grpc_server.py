"""The gRPC front end against a deterministic fake engine service (tests/grpc_harness.py):
messages in and out, status codes, cancellation, deadlines, health, the bearer token, TLS
and reflection. The default model's turn is in test_grpc_default_model.py."""

import json
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_harness import FakeEngineService, ServerThread, expected_output, self_signed_certificate, serving_client
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.tokenizer import Tokenizer
from shiftjax.serving.client.grpc_client import Client
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from loopback import wait_for

FREE_AT_ONCE_SECONDS = 0.5  # how soon pages must be back after a cancel or an expired deadline


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_path())


@pytest.fixture(scope="module")
def fake(tokenizer):
    return FakeEngineService(tokenizer, fail_on_prompt=(7, 7, 7))


@pytest.fixture(scope="module")
def server(fake):
    thread = ServerThread(fake)
    yield thread
    thread.stop()


@pytest.fixture
def client(server):
    with serving_client(server.address) as c:
        yield c


def test_checked_in_generated_code_is_what_protoc_writes():
    from shiftjax.serving.proto import regenerate

    assert regenerate.differences() == []


def test_generate_streams_each_token_then_finish_reason_and_usage(client, tokenizer):
    responses = list(client.generate(prompt_ids=[1, 2, 3], max_tokens=5))
    assert [list(r.token_ids) for r in responses] == [[t] for t in expected_output([1, 2, 3], 5)]
    assert "".join(r.text for r in responses) == tokenizer.decode(expected_output([1, 2, 3], 5))
    assert [r.finish_reason for r in responses] == [0] * 4 + [pb.FINISH_REASON_LENGTH]
    assert [r.HasField("usage") for r in responses] == [False] * 4 + [True]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.output_tokens, list(usage.modes)) == (3, 5, ["tp"] * 5)
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id


def test_text_and_chat_prompts_are_encoded_as_offline_generate_encodes_them(client, fake, tokenizer):
    client.complete("Hello there", max_tokens=1)
    assert fake.submitted[-1].prompt_ids == tuple(tokenizer.encode("Hello there", add_special_tokens=True))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    client.complete(messages=messages, max_tokens=1)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert fake.submitted[-1].prompt_ids == tuple(tokenizer.encode(rendered, add_special_tokens=False))
    assert client.tokenize(messages=messages) == list(fake.submitted[-1].prompt_ids)


def test_sampling_fields_reach_the_service_and_absent_ones_keep_their_defaults(client, fake):
    client.complete(prompt_ids=[5], max_tokens=2, temperature=0.5, top_p=0.75, top_k=3, min_p=0.25, seed=9,
                    stop=["ab"], stop_token_ids=[2], ignore_eos=True, logprobs=True, top_logprobs=2)
    params = fake.submitted[-1].params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == \
        (2, 0.5, 0.75, 3, 0.25, 9)
    assert (params.stop, params.stop_token_ids, params.ignore_eos, params.top_logprobs) == (("ab",), (2,), True, 2)
    client.complete(prompt_ids=[5])
    assert fake.submitted[-1].params == type(params)()


def test_logprobs_and_stop_token_travel(client):
    first = expected_output([4], 3)
    completion = client.complete(prompt_ids=[4], max_tokens=8, stop_token_ids=[first[2]],
                                 logprobs=True, top_logprobs=2)
    assert completion.token_ids == first and completion.finish_reason == "stop"
    assert [(lp.token_id, round(lp.logprob, 3), len(lp.top)) for lp in completion.logprobs] == \
        [(t, -0.5, 2) for t in first]
    last = list(client.generate(prompt_ids=[4], max_tokens=8, stop_token_ids=[first[2]]))[-1]
    assert last.WhichOneof("stop_reason") == "stop_token_id" and last.stop_token_id == first[2]


INVALID = [
    ({}, "prompt"),
    ({"prompt": "hi", "prompt_ids": [1]}, "prompt_ids"),
    ({"prompt_ids": [1], "n": 2}, "n"),
    ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt_ids": [1], "max_tokens": 100_000}, "max_tokens"),
    ({"prompt_ids": [1], "temperature": -1.0}, "temperature"),
    ({"prompt_ids": [1], "temperature": float("nan")}, "temperature"),
    ({"prompt_ids": [1], "top_p": 0.0}, "top_p"),
    ({"prompt_ids": [1], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"prompt_ids": [1], "top_logprobs": 1}, "top_logprobs"),
    ({"prompt_ids": [1, 10**9]}, "prompt_ids"),
    ({"prompt_ids": [-1]}, "prompt_ids"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}]}, "messages.1.role"),
    ({"prompt_ids": [1], "request_id": "x" * 129}, "request_id"),
    ({"prompt_ids": [1], "request_id": "id\x1b[2J"}, "request_id"),  # a terminal escape
]


@pytest.mark.parametrize("fields, field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_requests_get_invalid_argument_naming_the_field(client, fake, fields, field):
    with pytest.raises(grpc.RpcError) as caught:
        client.complete(**fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()
    assert fake.free_pages == fake.num_pages


def test_the_cache_salt_reaches_the_service_and_a_mistyped_one_is_refused_by_name(client, fake):
    client.complete(prompt_ids=[5], max_tokens=1, cache_salt="tenant-a")
    assert fake.submitted[-1].cache_salt == "tenant-a"
    client.complete(prompt_ids=[5], max_tokens=1, cache_salt="")  # proto3: an empty string is the field left out
    assert fake.submitted[-1].cache_salt is None
    # cache_salt (field 17, a string) sent as a varint, as a client with a wrong .proto would
    wrong = pb.GenerateRequest(prompt_ids=[5], max_tokens=1).SerializeToString() + bytes([0x88, 0x01, 7])  # tag 17<<3|0
    generate = client.channel.unary_stream("/shiftjax.v1.InferenceService/Generate",
                                           response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as caught:
        list(generate(wrong, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("cache_salt: must be a string"), caught.value.details()
    assert fake.free_pages == fake.num_pages


def test_full_queue_is_resource_exhausted_and_draining_service_unavailable(client, fake):
    fake.max_running = 0
    try:
        with pytest.raises(grpc.RpcError) as caught:
            client.complete(prompt_ids=[1])
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        fake.max_running = 64
    fake.draining = True
    try:
        with pytest.raises(grpc.RpcError) as caught:
            client.complete(prompt_ids=[1])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        fake.draining = False


def test_a_request_failing_mid_stream_is_internal_and_the_server_keeps_serving(client, fake):
    call = client.generate(prompt_ids=[7, 7, 7], max_tokens=10)
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in caught.value.details()
    assert client.complete(prompt_ids=[1], max_tokens=3).token_ids == expected_output([1], 3)
    assert fake.free_pages == fake.num_pages


def test_cancelling_mid_stream_frees_the_pages_at_once(client, fake):
    stream = client.generate(prompt_ids=[3], max_tokens=400)
    for _ in range(3):
        next(stream)
    assert fake.free_pages < fake.num_pages
    stream.close()  # leaving the loop early: the client cancels the call
    cancelled_at = time.monotonic()
    assert wait_for(lambda: fake.free_pages == fake.num_pages, FREE_AT_ONCE_SECONDS)
    assert time.monotonic() - cancelled_at < FREE_AT_ONCE_SECONDS
    assert client.info().free_pages == fake.num_pages


def test_a_client_process_killed_mid_stream_frees_the_pages_at_once(server, fake):
    """A disconnect without a goodbye: the client process dies (SIGKILL) while streaming."""
    code = ("import sys; from shiftjax.serving.client.grpc_client import Client\n"
            f"stream = Client({server.address!r}).generate(prompt_ids=[6], max_tokens=400)\n"
            "next(stream); print('streaming', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "streaming"
        assert fake.free_pages < fake.num_pages
    finally:
        child.kill()
        child.wait(10)
    assert wait_for(lambda: fake.free_pages == fake.num_pages, FREE_AT_ONCE_SECONDS)


def test_an_expired_deadline_frees_the_pages_at_once_and_reaches_the_service(client, fake):
    before = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        client.complete(prompt_ids=[3], max_tokens=400, timeout=0.2)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: fake.free_pages == fake.num_pages, FREE_AT_ONCE_SECONDS)
    deadline = fake.submitted[-1].deadline
    assert deadline is not None and before < deadline < before + 0.2 + 0.05


class _PastDeadlineContext:
    """What Generate reads of a grpc.aio context, for a call whose deadline passes 50 ms in.
    Over the wire the client's own clock would answer DEADLINE_EXCEEDED by then, whatever
    the server said; called directly, the servicer's own answer shows."""

    class Aborted(Exception):
        pass

    def time_remaining(self) -> float:
        return 0.05

    async def abort(self, code, message):
        raise self.Aborted(code, message)


@pytest.mark.parametrize("cancelled", [True, False], ids=["cancelled after the deadline", "expired"])
def test_deadline_exceeded_is_the_services_word_not_the_clocks(tokenizer, cancelled):
    """An abort the service streams is an abort, even when it is read past the call's
    deadline (a cancel or drain that came late); DEADLINE_EXCEEDED answers the service's
    DeadlineExceeded alone."""
    import asyncio

    from shiftjax.serving.server.grpc_server import InferenceServicer

    fake = FakeEngineService(tokenizer)
    context = _PastDeadlineContext()

    async def main():
        responses = InferenceServicer(fake).Generate(
            pb.GenerateRequest(prompt_ids=[3], max_tokens=400, request_id="late"), context)
        first = await anext(responses)
        await asyncio.sleep(0.1)
        assert first.request_id == "late"  # the client's label; the service keys it by its own id
        if cancelled:
            (service_id,) = fake.live
            assert fake.cancel(service_id)
        return [first] + [r async for r in responses]

    if cancelled:
        responses = asyncio.run(main())
        assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    else:
        with pytest.raises(_PastDeadlineContext.Aborted) as caught:
            asyncio.run(main())
        code, message = caught.value.args
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in message
    assert fake.free_pages == fake.num_pages


def test_tokenize_and_detokenize(client, tokenizer):
    ids = client.tokenize("Shift parallelism", add_special_tokens=False)
    assert ids == tokenizer.encode("Shift parallelism", add_special_tokens=False)
    assert client.detokenize(ids) == "Shift parallelism"
    with pytest.raises(grpc.RpcError) as caught:
        client.detokenize([1, tokenizer.vocab_size])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("token_ids:")


def test_server_info_reports_the_service(client, fake):
    info = client.info()
    assert (info.model, list(info.modes), dict(info.mesh)) == ("fake", ["tp", "sp"], {"sp": 2, "tp": 2})
    assert (list(info.token_buckets), list(info.seq_buckets), info.page_size) == ([16, 64], [4], 16)
    assert (info.num_pages, info.free_pages, info.executables, info.policy) == (256, 256, 4, "auto")
    assert sorted((t.mode, t.tokens, t.seqs, t.seconds) for t in info.timings) == \
        [("sp", 64, 4, 0.02), ("tp", 16, 4, 0.01)]
    assert info.ready and not info.draining
    assert info.max_model_len == fake.max_model_len
    assert json.loads(info.info_json)["policy"]["timing"][0] == {"mode": "tp", "tokens": 16, "seqs": 4, "seconds": 0.01}


def health_status(address, **channel) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service="shiftjax.v1.InferenceService"), timeout=5).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_health_is_not_serving_until_ready_and_again_while_draining(tokenizer):
    thread = ServerThread(None)
    try:
        client = Client(thread.address, timeout=10.0)
        assert health_status(thread.address) == "NOT_SERVING" and client.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            client.complete(prompt_ids=[1])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        service = FakeEngineService(tokenizer, step_seconds=0.01)
        service.ready = False
        thread.call_soon(thread.server.attach, service)
        time.sleep(0.5)
        assert client.health() == "NOT_SERVING"  # attached but not ready
        service.ready = True
        client.wait_until_serving(5.0, poll_seconds=0.05)
        running = client.generate(prompt_ids=[2], max_tokens=60)  # ~0.6 s
        first = next(running)
        import asyncio

        drained = asyncio.run_coroutine_threadsafe(thread.server.drain(10.0), thread.loop)
        assert wait_for(lambda: client.health() == "NOT_SERVING", 2)
        with pytest.raises(grpc.RpcError) as caught:
            client.complete(prompt_ids=[1])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(running)  # the running request finishes within the grace
        assert list(first.token_ids) + [t for r in rest for t in r.token_ids] == expected_output([2], 60)
        drained.result(10)
        assert service.free_pages == service.num_pages
    finally:
        thread.loop.call_soon_threadsafe(thread.loop.stop)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secure_server(fake, certificate):
    thread = ServerThread(fake, tls=certificate, api_key="s3cret")
    yield thread
    thread.stop()


def rpc_code(function, *args, **kwargs):
    try:
        result = function(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_token_and_tls_refuse_and_admit_what_they_should(secure_server, certificate):
    cert, _ = certificate
    address = secure_server.address
    with Client(address, root_certificates=cert, api_key="s3cret", timeout=10.0) as good:
        assert good.complete(prompt_ids=[1], max_tokens=2).token_ids == expected_output([1], 2)
        assert good.info().model == "fake"
    # one rule with HTTP's (validation.bearer_token_matches): the scheme in any case, the token exact
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(cert)) as channel:
        from shiftjax.serving.proto.shiftjax.v1 import inference_pb2_grpc as pb_grpc

        stub = pb_grpc.InferenceServiceStub(channel)
        for header, code in [("bearer s3cret", grpc.StatusCode.OK), ("Bearer  s3cret ", grpc.StatusCode.OK),
                             ("Basic s3cret", grpc.StatusCode.UNAUTHENTICATED),
                             ("Bearer s3cret2", grpc.StatusCode.UNAUTHENTICATED),
                             ("Bearers3cret", grpc.StatusCode.UNAUTHENTICATED)]:
            assert rpc_code(stub.ServerInfo, pb.ServerInfoRequest(), metadata=[("authorization", header)],
                            timeout=10) == code, header
    for api_key in (None, "wrong", "s3cre"):
        with Client(address, root_certificates=cert, api_key=api_key, timeout=10.0) as bad:
            assert rpc_code(bad.generate, prompt_ids=[1], max_tokens=2) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_code(bad.info) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_code(bad.tokenize, "x") == grpc.StatusCode.UNAUTHENTICATED
            assert bad.health() == "SERVING"  # health stays open to probes without credentials
    with Client(address, api_key="s3cret", timeout=5.0) as plaintext:  # no TLS against a TLS port
        assert rpc_code(plaintext.info) == grpc.StatusCode.UNAVAILABLE
    with Client(address, tls=True, api_key="s3cret", timeout=5.0) as untrusted:  # system roots lack our CA
        assert rpc_code(untrusted.info) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(cert)) as channel:  # reflection is guarded too
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        assert rpc_code(stub.ServerReflectionInfo, requests, timeout=5) == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_knowing_only_reflection_lists_calls_and_streams(server, fake):
    """No generated code: descriptors come from the server, message classes are built from
    a fresh pool (independent of the generated modules this process has imported)."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"shiftjax.v1.InferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("shiftjax.v1.InferenceService")
        assert {m.name for m in service.methods} == {"Generate", "Tokenize", "Detokenize", "ServerInfo"}

        def method_call(name, streaming):
            method = service.methods_by_name[name]
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            make = channel.unary_stream if streaming else channel.unary_unary
            call = make(f"/{service.full_name}/{name}", request_serializer=request_class.SerializeToString,
                        response_deserializer=response_class.FromString)
            return call, request_class

        server_info, info_request = method_call("ServerInfo", streaming=False)
        info = server_info(info_request(), timeout=10)
        assert info.model == "fake" and info.num_pages == fake.num_pages
        generate, generate_request = method_call("Generate", streaming=True)
        responses = list(generate(generate_request(prompt_ids=[9, 9], max_tokens=4), timeout=10))
        assert [t for r in responses for t in r.token_ids] == expected_output([9, 9], 4)
        assert responses[-1].usage.output_tokens == 4
        assert pool.FindEnumTypeByName("shiftjax.v1.FinishReason").values_by_number[
            responses[-1].finish_reason].name == "FINISH_REASON_LENGTH"


# The server's threads use `random` (grpc), which Hypothesis notices and warns about.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_malformed_and_out_of_range_requests_get_invalid_argument_and_leak_nothing(client, fake, tokenizer):
    """The fake's quick run of the property; test_grpc_default_model.py runs it on the model."""
    from hypothesis import HealthCheck, given, settings

    from grpc_invalid_requests import check_one_request, generate_requests

    outcomes = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(generate_requests(tokenizer.vocab_size, fake.max_model_len))
    def check(case):
        outcomes.append(check_one_request(client, case, lambda: fake.free_pages == fake.num_pages))

    check()
    assert {"valid", "refused"} <= set(outcomes)  # the strategy reaches both sides
