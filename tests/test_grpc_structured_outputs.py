"""Structured outputs over gRPC: ``GenerateRequest.structured_outputs`` read into the
engine's :class:`StructuredOutputs` for every kind, every malformed message refused with
INVALID_ARGUMENT naming the field as inference.proto spells it, the client's dataclass and
``shiftjax client``'s flags (against the fake service); then the default model behind a real
gRPC server on loopback: a JSON schema, a regex and a choice constrain greedy outputs, a
constraint that does not compile is refused by name and the server serves the next request.
"""

import json
import re

import grpc
import pytest

from grpc_harness import FakeEngineService, ServerThread, serving_client
from loopback import wait_for
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.tokenizer import Tokenizer
from shiftjax.serving.client.cli import client_main
from shiftjax.serving.client.grpc_client import StructuredOutputs as ClientConstraint
from shiftjax.serving.client.grpc_client import generate_request
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.structured_outputs import StructuredOutputs
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from shiftjax.serving.server import grpc_messages

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA_TEXT = json.dumps(SCHEMA)
GRAMMAR = 'start: "(" item ("," item)* ")"\nitem: /[0-9]+/'
UNCOMPILABLE_REGEX = "[0-9"  # the fake refuses it as the engine would; the real engine really does
UNCOMPILABLE_SCHEMA = '{"type": "nonsense"}'

VALID = [  # (the proto's constraint, the engine's)
    (pb.StructuredOutputs(json_schema=SCHEMA_TEXT), StructuredOutputs(json=SCHEMA_TEXT)),
    (pb.StructuredOutputs(json_object=True), StructuredOutputs(json_object=True)),
    (pb.StructuredOutputs(regex="[0-9]{3}-[0-9]{4}"), StructuredOutputs(regex="[0-9]{3}-[0-9]{4}")),
    (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["yes", "no"])), StructuredOutputs(choice=("yes", "no"))),
    (pb.StructuredOutputs(grammar=GRAMMAR), StructuredOutputs(grammar=GRAMMAR)),
]
INVALID = [  # (the proto's constraint, the field its refusal names)
    (pb.StructuredOutputs(), "structured_outputs"),  # no oneof member set
    (pb.StructuredOutputs(json_schema=""), "structured_outputs.json_schema"),
    (pb.StructuredOutputs(json_schema="{not json"), "structured_outputs.json_schema"),
    (pb.StructuredOutputs(json_schema="[1, 2]"), "structured_outputs.json_schema"),  # JSON, but no schema
    (pb.StructuredOutputs(json_object=False), "structured_outputs.json_object"),
    (pb.StructuredOutputs(regex=""), "structured_outputs.regex"),
    (pb.StructuredOutputs(choice=pb.ChoiceList()), "structured_outputs.choice"),
    (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["yes", ""])), "structured_outputs.choice"),
    (pb.StructuredOutputs(grammar=""), "structured_outputs.grammar"),
]


def over_the_wire(constraint: pb.StructuredOutputs) -> pb.GenerateRequest:
    """A request carrying ``constraint`` as the server parses it: a oneof member keeps its
    presence on the wire even when it holds the zero value."""
    request = pb.GenerateRequest(prompt_ids=[1, 2], max_tokens=2, structured_outputs=constraint)
    return pb.GenerateRequest.FromString(request.SerializeToString())


@pytest.mark.parametrize("constraint, expected", VALID, ids=[e.kind for _, e in VALID])
def test_each_kind_is_read_into_the_engines_constraint(constraint, expected):
    assert grpc_messages.sampling_params_from(over_the_wire(constraint)).structured_outputs == expected


def test_no_constraint_is_none():
    assert grpc_messages.sampling_params_from(pb.GenerateRequest(prompt_ids=[1])).structured_outputs is None


@pytest.mark.parametrize("constraint, field", INVALID, ids=[str(c).strip() or "empty" for c, _ in INVALID])
def test_each_malformed_constraint_is_refused_naming_the_protos_field(constraint, field):
    with pytest.raises(InvalidRequest) as caught:
        grpc_messages.sampling_params_from(over_the_wire(constraint))
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize("tail, field", [
    (bytes([0x92, 0x01, 2, 0x12, 0]), "structured_outputs.json_object"),  # json_object (a bool) sent as bytes
    (bytes([0x92, 0x01, 4, 0x22, 2, 0x08, 1]), "structured_outputs.choice.choices"),  # a choice sent as a varint
    (bytes([0x90, 0x01, 1]), "structured_outputs"),  # the message itself sent as a varint
])
def test_a_mistyped_constraint_field_is_refused_naming_its_path(tail, field):
    request = pb.GenerateRequest.FromString(pb.GenerateRequest(prompt_ids=[1]).SerializeToString() + tail)
    with pytest.raises(InvalidRequest) as caught:
        grpc_messages.refuse_mistyped_fields(request)
    assert caught.value.field == field


def test_the_engines_field_names_become_the_protos():
    class Refusing:
        def check_structured_outputs(self, params):
            raise InvalidRequest("structured_outputs.json", "does not compile: Invalid type: nonsense")

    params = grpc_messages.sampling_params_from(over_the_wire(pb.StructuredOutputs(json_schema=UNCOMPILABLE_SCHEMA)))
    with pytest.raises(InvalidRequest) as caught:
        grpc_messages.check_structured_outputs(Refusing(), params)
    assert str(caught.value) == "structured_outputs.json_schema: does not compile: Invalid type: nonsense"
    unconstrained = grpc_messages.sampling_params_from(pb.GenerateRequest(prompt_ids=[1]))
    grpc_messages.check_structured_outputs(Refusing(), unconstrained)  # no constraint: nothing to compile


def test_the_client_dataclass_mirrors_the_oneof():
    assert ClientConstraint(json_schema=SCHEMA).to_proto() == pb.StructuredOutputs(json_schema=json.dumps(SCHEMA))
    assert ClientConstraint(json_schema=SCHEMA_TEXT).to_proto().json_schema == SCHEMA_TEXT
    assert ClientConstraint(choice=["a", "b"]).to_proto() == \
        pb.StructuredOutputs(choice=pb.ChoiceList(choices=["a", "b"]))
    assert generate_request(prompt_ids=[1], structured_outputs=ClientConstraint(json_object=True)) \
        .structured_outputs.WhichOneof("constraint") == "json_object"
    assert not generate_request(prompt_ids=[1]).HasField("structured_outputs")
    for wrong in ({}, {"regex": "a", "grammar": GRAMMAR}, {"choice": "yes"}):
        with pytest.raises(ValueError, match="structured outputs"):
            ClientConstraint(**wrong)


class ConstrainedFake(FakeEngineService):
    """The fake service, compiling as the real one refuses: the two uncompilable constraints."""

    def check_structured_outputs(self, params) -> None:
        spec = params.structured_outputs
        if spec.regex == UNCOMPILABLE_REGEX:
            raise InvalidRequest("structured_outputs.regex", "does not compile: unclosed character class")
        if spec.json == UNCOMPILABLE_SCHEMA:
            raise InvalidRequest("structured_outputs.json", "does not compile: Invalid type: nonsense")


@pytest.fixture(scope="module")
def fake_server():
    thread = ServerThread(ConstrainedFake(Tokenizer.from_dir(default_model_path())))
    yield thread
    thread.stop()


@pytest.fixture
def fake(fake_server):
    return fake_server.server.servicer.service


def test_through_grpc_each_kind_reaches_the_service_and_each_malformed_one_is_invalid_argument(fake_server, fake):
    with serving_client(fake_server.address) as client:
        for constraint, expected in VALID:
            assert client.complete(prompt_ids=[1, 2], max_tokens=2, structured_outputs=constraint).finish_reason
            assert fake.submitted[-1].params.structured_outputs == expected
        refused = INVALID + [(pb.StructuredOutputs(regex=UNCOMPILABLE_REGEX), "structured_outputs.regex"),
                             (pb.StructuredOutputs(json_schema=UNCOMPILABLE_SCHEMA), "structured_outputs.json_schema")]
        submitted = len(fake.submitted)
        for constraint, field in refused:
            with pytest.raises(grpc.RpcError) as caught:
                client.complete(prompt_ids=[1, 2], max_tokens=2, structured_outputs=constraint)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"{field}: "), caught.value.details()
        assert len(fake.submitted) == submitted and fake.free_pages == fake.num_pages


def run_cli(fake_server, *flags) -> int:
    return client_main(["generate", "--server", fake_server.address, "--prompt-ids", "1,2", "--max-tokens", "2",
                        *flags])


def test_the_cli_flags_send_each_kind(fake_server, fake, tmp_path, capsys):
    schema_file, grammar_file = tmp_path / "schema.json", tmp_path / "tuple.lark"
    schema_file.write_text(SCHEMA_TEXT)
    grammar_file.write_text(GRAMMAR)
    for flags, expected in [
        (["--json-schema", str(schema_file)], StructuredOutputs(json=SCHEMA_TEXT)),
        (["--json-schema", SCHEMA_TEXT], StructuredOutputs(json=SCHEMA_TEXT)),  # inline
        (["--json-object"], StructuredOutputs(json_object=True)),
        (["--regex", "[a-z]+"], StructuredOutputs(regex="[a-z]+")),
        (["--choice", "yes", "--choice", "no"], StructuredOutputs(choice=("yes", "no"))),
        (["--grammar", str(grammar_file)], StructuredOutputs(grammar=GRAMMAR)),
    ]:
        assert run_cli(fake_server, *flags) == 0, flags
        assert fake.submitted[-1].params.structured_outputs == expected, flags
    assert run_cli(fake_server) == 0
    assert fake.submitted[-1].params.structured_outputs is None
    assert run_cli(fake_server, "--regex", UNCOMPILABLE_REGEX) == 1
    assert "INVALID_ARGUMENT: structured_outputs.regex: does not compile" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--regex", "a", "--choice", "b"], "argument --choice: not allowed with argument --regex"),
    (["--json-object", "--json-schema", "{}"], "argument --json-schema: not allowed with argument --json-object"),
    (["--grammar", "g.lark", "--regex", "a"], "not allowed with argument"),
    (["--json-schema", "{not json"], "argument --json-schema: the inline schema is not valid JSON"),
    (["--json-schema", "no-such-schema.json"], "argument --json-schema: cannot read the schema file"),
    (["--json-schema", "[1]"], "cannot read the schema file '[1]'"),  # not '{': a file name
    (["--grammar", "no-such-grammar.lark"], "argument --grammar: cannot read the grammar file"),
    (["--regex", ""], "argument --regex: must not be empty"),
    (["--choice", "a", "--choice", ""], "argument --choice: must not be empty"),
])
def test_the_cli_refuses_conflicting_or_unreadable_constraints(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.lark").write_text(GRAMMAR)
    with pytest.raises(SystemExit) as caught:
        client_main(["generate", "--server", "127.0.0.1:1", "x", *flags])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_refuses_a_schema_file_that_is_no_schema(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.lark").write_text("\n")
    for flags, message in [(["--json-schema", str(tmp_path / "list.json")], "is not a JSON schema"),
                           (["--grammar", str(tmp_path / "empty.lark")], "is empty")]:
        with pytest.raises(SystemExit):
            client_main(["chat", "--server", "127.0.0.1:1", "x", *flags])
        assert message in capsys.readouterr().err


# The default model (SmolLM2-135M-Instruct) on one CPU device, behind a real gRPC server.
ENGINE = dict(max_model_len=256, page_size=16, num_pages=48, max_num_seqs=4, max_num_batched_tokens=64,
              token_buckets=(4, 64), seq_buckets=(4,), mode="tp")
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def served():
    from shiftjax.serving.engine.llm import LLM
    from shiftjax.serving.server.service import AsyncEngineService

    llm = LLM("default", **ENGINE)
    service = AsyncEngineService(llm.engine, llm.tokenizer, model_name="default")
    thread = ServerThread(service)
    yield thread, service
    thread.stop()
    service.shutdown()


@pytest.fixture
def client(served):
    with serving_client(served[0].address, timeout=120.0) as c:
        c.wait_until_serving(120.0, poll_seconds=0.1)
        yield c


def ask(client, question: str, constraint: ClientConstraint):
    return client.complete(messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                           structured_outputs=constraint)


@pytest.mark.slow
def test_a_json_schema_constrains_the_answer(client):
    import jsonschema

    done = ask(client, "Describe a person as JSON with a name and an age.", ClientConstraint(json_schema=SCHEMA))
    assert done.finish_reason == "stop", done.text
    jsonschema.validate(json.loads(done.text), SCHEMA)


@pytest.mark.slow
def test_a_regex_and_a_choice_constrain_the_answer(client):
    done = ask(client, "Give me a phone number.", ClientConstraint(regex="[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", done.text) and done.finish_reason == "stop", done.text
    done = ask(client, "Is the sky blue? Answer yes or no.", ClientConstraint(choice=["yes", "no"]))
    assert done.text in ("yes", "no") and done.finish_reason == "stop", done.text


@pytest.mark.slow
def test_an_uncompilable_constraint_is_refused_by_name_and_the_next_request_served(client, served):
    service = served[1]
    for constraint, field in [(ClientConstraint(regex=UNCOMPILABLE_REGEX), "structured_outputs.regex"),
                              (ClientConstraint(json_schema=UNCOMPILABLE_SCHEMA), "structured_outputs.json_schema")]:
        with pytest.raises(grpc.RpcError) as caught:
            ask(client, "Anything.", constraint)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field}: does not compile"), caught.value.details()
        done = ask(client, "Give me a number.", ClientConstraint(regex="[0-9]{2}"))
        assert re.fullmatch("[0-9]{2}", done.text), done.text
    assert wait_for(lambda: service.stats().engine.free_pages == service.stats().engine.num_pages, 5)


@pytest.mark.slow
def test_the_cli_constrains_a_chat_on_the_real_server(served, capsys):
    assert client_main(["chat", "--server", served[0].address, "--max-tokens", str(MAX_TOKENS),
                        "--choice", "red", "--choice", "green", "--choice", "blue", "Name a colour."]) == 0
    assert capsys.readouterr().out.strip() in ("red", "green", "blue")
