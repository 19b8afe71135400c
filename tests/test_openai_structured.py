"""Structured outputs and tool calls on the OpenAI front end, against the fake service: every
field mapped to the engine's constraint, every refusal named by the field as the client
spelled it, the tool-call readers (streamed replies split at every point read the same as
whole ones), and the official openai client reassembling streamed tool calls."""

import json
import random

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_fake_service import FakeService
from http_live_server import live_server
from shiftjax.serving.engine.structured_outputs import StructuredOutputs
from shiftjax.serving.server.http_server import create_app
from shiftjax.serving.server.openai_structured import CALL_LAYOUT, NO_PARAMETERS, Tool, required_schema
from shiftjax.serving.server.tool_calls import (
    HermesParser, NamedCallParser, RequiredCallsParser, assemble, parse_whole,
)

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
          "required": ["zeta", "alpha"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture
def service():
    return FakeService(max_model_len=4096)


@pytest.fixture
def client(service):
    with TestClient(create_app(service, model_name="m", tool_call_parser="hermes")) as client:
        yield client


@pytest.fixture
def plain(service):  # no --tool-call-parser
    with TestClient(create_app(service, model_name="m")) as client:
        yield client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 300} | body)


def complete(client, **body):
    return client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30} | body)


def refused(response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


# The mapping of each field to the engine's constraint

@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutputs(json='{"type": "integer"}')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, StructuredOutputs(regex="[a-z]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, StructuredOutputs(grammar='start: "a" | "b"')),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "llguidance"},
     StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":")))),
    ({"guided_regex": "[0-9]+", "guided_decoding_backend": "auto"}, StructuredOutputs(regex="[0-9]+")),
    ({"guided_choice": ["x", "y z"]}, StructuredOutputs(choice=("x", "y z"))),
    ({"guided_grammar": "start: /[ab]+/"}, StructuredOutputs(grammar="start: /[ab]+/")),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a", "json": None, "json_object": False}}, StructuredOutputs(regex="a")),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
@pytest.mark.parametrize("endpoint", [chat, complete])
def test_each_field_becomes_the_engines_constraint(client, service, endpoint, body, expected):
    r = endpoint(client, **body)
    assert r.status_code == 200, r.text
    (submitted,) = service.submitted
    assert submitted.params.structured_outputs == expected
    assert service.checked == ([] if expected is None else [expected])  # compiled before it was submitted
    assert submitted.grammar == (None if expected is None else ("compiled", expected))  # and sent with it


def test_a_schema_keeps_its_property_order(client, service):
    """llguidance writes properties in the schema's order: the client's order is kept."""
    chat(client, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    spec = service.submitted[0].params.structured_outputs
    assert list(json.loads(spec.json)["properties"]) == ["zeta", "alpha"]


def test_every_prompt_of_a_completion_gets_the_constraint(client, service):
    r = complete(client, prompt=["a", "b", "c"], structured_outputs={"regex": "[a-z]+"})
    assert r.status_code == 200
    assert [s.params.structured_outputs for s in service.submitted] == [StructuredOutputs(regex="[a-z]+")] * 3
    assert len(service.checked) == 1  # one compile serves them all
    assert {s.grammar for s in service.submitted} == {("compiled", StructuredOutputs(regex="[a-z]+"))}


# Refusals, each naming the field as the client spelled it

BAD_CONSTRAINTS = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/$defs/x"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": "x"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": "a{2,1}"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": {}, "structured_outputs": {"regex": "a"}}, "guided_json"),
    ({"guided_choice": ["a"], "guided_grammar": "start: /a/"}, "guided_grammar"),
]


@pytest.mark.parametrize("body, field", BAD_CONSTRAINTS, ids=[f for _, f in BAD_CONSTRAINTS])
@pytest.mark.parametrize("endpoint", [chat, complete])
def test_bad_constraints_are_refused_by_field(client, service, endpoint, body, field):
    r = endpoint(client, **body)
    assert refused(r) == field
    assert r.json()["error"]["message"].startswith(f"{field}: ")
    assert not service.submitted and not service.live


def test_two_constraints_are_named_together(client):
    r = chat(client, response_format={"type": "json_object"}, guided_regex="a")
    assert "response_format and guided_regex" in r.json()["error"]["message"]
    r = chat(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert refused(r) == "tool_choice"
    assert "response_format and tool_choice" in r.json()["error"]["message"]


BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools.0"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": 1}}]},
     "tools.0.function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}, "tools.0.function.arguments"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "get_time"}}]}, "tools.2.function.name"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "get_time"}}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS[:1] + [{"type": "function", "function": {"name": "bad", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "foo"}}}],
      "tool_choice": {"type": "function", "function": {"name": "bad"}}}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": n, "parameters": {"$defs": {"d": {"type": t}}}}}
                for n, t in (("a", "string"), ("b", "integer"))], "tool_choice": "required"},
     "tools.1.function.parameters.$defs.d"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("body, field", BAD_TOOLS, ids=[f for _, f in BAD_TOOLS])
def test_bad_tools_are_refused_by_field(client, service, body, field):
    assert refused(chat(client, **body)) == field
    assert not service.submitted


def test_auto_tool_choice_needs_a_parser(plain, service):
    r = chat(plain, tools=TOOLS)  # "auto" by default: the field the client sent is named
    assert refused(r) == "tools" and "--tool-call-parser" in r.json()["error"]["message"]
    assert refused(chat(plain, tools=TOOLS, tool_choice="auto")) == "tool_choice"
    assert chat(plain, tools=TOOLS, tool_choice="none").status_code == 200
    assert chat(plain, tools=TOOLS, tool_choice="required").status_code == 200
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        create_app(service, model_name="m", tool_call_parser="mistral")


def test_completions_take_no_tools(client):
    assert refused(complete(client, tools=TOOLS)) == "tools"


# Tools, tool calls and tool messages reach the chat template

def test_tools_reach_the_template_and_none_constrains_nothing(client, service):
    service.reply = "plain words"
    r = chat(client, tools=TOOLS, tool_choice="none")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "plain words"}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    (submitted,) = service.submitted
    assert submitted.params.structured_outputs is None
    prompt = service.tokenizer.decode(submitted.prompt_ids)
    assert prompt.startswith("[tools]" + json.dumps(TOOLS) + "\n")


def test_tool_messages_answer_the_calls_before_them(client, service):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    assert chat(client, messages=messages, tools=TOOLS, tool_choice="none").status_code == 200
    prompt = service.tokenizer.decode(service.submitted[0].prompt_ids)
    rendered = dict(call, function={"name": "get_weather", "arguments": {"city": "Oslo"}})  # decoded for templates
    assert "[assistant]" + json.dumps({"tool_calls": [rendered]}) + "\n" in prompt
    assert "[tool]-3 C" + json.dumps({"tool_call_id": "call_1", "name": "get_weather"}) + "\n" in prompt


@pytest.mark.parametrize("messages, field", [
    ([{"role": "tool", "content": "x", "tool_call_id": "call_1"}], "messages.0.role"),
    (USER + [{"role": "assistant", "content": "no calls"}, {"role": "tool", "content": "x", "tool_call_id": "c"}],
     "messages.2.role"),
    (USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "content": "x", "tool_call_id": "c2"}], "messages.2.tool_call_id"),
    (USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "content": "x"}], "messages.2.tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages.0.tool_call_id"),
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages.0.tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls.0.id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}],
     "messages.0.tool_calls.0.function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages.0.tool_calls.0.function.name"),
])
def test_bad_tool_messages_are_refused_by_field(client, messages, field):
    assert refused(chat(client, messages=messages)) == field


def test_a_real_template_renders_tools_and_calls():
    """A Qwen2.5-style template through the checkpoint tokenizer, as Hugging Face renders it."""
    import tokenizers

    from shiftjax.checkpoints.tokenizer import Tokenizer
    from shiftjax.serving.server import openai_schema as schema

    template = (
        "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{% endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' and message.tool_calls %}<a>"
        "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
        "{%- set tool_call = tool_call.function %}{%- endif %}"
        '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}</tool_call>'
        "{%- endfor %}</a>"
        "{%- elif message.role == 'tool' %}<tool_response>{{ message.content }}</tool_response>"
        "{%- else %}<{{ message.role }}>{{ message.content }}{%- endif %}{%- endfor %}")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = Tokenizer(backend, chat_template=template)
    body = schema.ChatCompletionRequest.model_validate({"messages": USER + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}]})
    text = tokenizer.apply_chat_template(schema.chat_messages(body), tools=TOOLS[1:])
    assert text == ('<tools>{"type": "function", "function": {"name": "get_time"}}</tools><user>hi'
                    '<a><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call></a>'
                    "<tool_response>12:00</tool_response>")


# The required-tool-call schema

def test_the_required_schema_takes_only_calls_of_the_tools():
    tools = (Tool(0, "get_weather", WEATHER, {}), Tool(1, "get_time", None, {}),
             Tool(2, "lookup", {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}},
                                "$defs": {"point": {"type": "array", "items": {"type": "number"}}}}, {}))
    schema = required_schema(tools)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}},
            {"name": "lookup", "parameters": {"p": [1, 2.5]}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_news", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time", "parameters": {"x": 1}}], [{"name": "lookup", "parameters": {"p": ["x"]}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools[2].parameters["$defs"]  # the request's own schema is left as it was
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:2], required_schema(tools, parallel=False))
    assert tools[1].arguments_schema == NO_PARAMETERS


# The readers, whole and streamed at every split

def calls_of(parsed):
    content, calls = parsed
    return content, [(c.name, c.arguments) for c in calls]


def streamed(make, pieces):
    parser, steps = make(), []
    for piece in pieces:
        steps.append(parser.feed(piece))
    steps.append(parser.finish())
    for step in steps:  # a call's first delta names it; later ones only append arguments
        for delta in step.calls:
            assert (delta.id is None) == (delta.name is None)
            assert delta.id is None or delta.id.startswith("call_") and len(delta.id) == 29
    return calls_of(assemble(steps))


def splits(text, rng):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def check_every_split(make, text, expected):
    assert calls_of(parse_whole(make(), text)) == expected
    rng = random.Random(text)
    for pieces in splits(text, rng):
        assert streamed(make, pieces) == expected, pieces


HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
     ("Let me check.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")])),
    ("No tools: 2 < 3, <tool or <tool_cal... and trailing space \n",
     ("No tools: 2 < 3, <tool or <tool_cal... and trailing space \n", [])),
    ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', ("", [("f", '{"x": 1}')])),
    ("<tool_call>not json</tool_call> after", ("<tool_call>not json</tool_call> after", [])),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "a } ] </tool_call> \\" {", "n": [1, {"m": null}]}}\n'
     "</tool_call>", ("", [("f", '{"s": "a } ] </tool_call> \\" {", "n": [1, {"m": null}]}')])),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', ("", [("f", '{"a": [1, 2')])),
    ('<tool_call>{"name": "f"}</tool_call>', ("", [("f", "{}")])),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', ("", [("f", '"{\\"a\\": 1}"')])),
    ('A <tool_call>{"name":"f","arguments":{}}</tool_call> B<tool_call>{"name":"g","arguments":{"k":-1.5e3}}'
     "</tool_call>C", ("A BC", [("f", "{}"), ("g", '{"k":-1.5e3}')])),
    ('<tool_call>{"name": "ünï", "arguments": {"t": "✓"}}</tool_call>', ("", [("ünï", '{"t": "✓"}')])),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', ("", [("f", '{"a": 1}')])),  # no closing }
    ("<tool_call>\n{\"name\": \"f\", \"argu", ("<tool_call>\n{\"name\": \"f\", \"argu", [])),
    ("", ("", [])),
]


@pytest.mark.parametrize("text, expected", HERMES, ids=range(len(HERMES)))
def test_hermes_reads_the_same_however_the_reply_is_split(text, expected):
    check_every_split(HermesParser, text, expected)


def test_hermes_keeps_one_call_without_parallel_tool_calls():
    text = HERMES[0][0]
    assert calls_of(parse_whole(HermesParser(max_calls=1), text)) == ("Let me check.", HERMES[0][1][1][:1])
    check_every_split(lambda: HermesParser(max_calls=1), text, ("Let me check.", HERMES[0][1][1][:1]))


REQUIRED = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
     ("", [("a", '{"x": 1}'), ("b", "{}")])),
    ('[ {"name":"a","arguments":{"s":"]}\\""}} ]', ("", [("a", '{"s":"]}\\""}')])),
    ('[{"name": "a", "parameters": {"x": [1, 2', ("", [("a", '{"x": [1, 2')])),  # cut by max_tokens
    ('[{"parameters": {"x": 1}, "name": "a"}]', ("", [("a", '{"x": 1}')])),
    ("hello", ("hello", [])),
    ('[{"name": "a"', ('[{"name": "a"', [])),
]


@pytest.mark.parametrize("text, expected", REQUIRED, ids=range(len(REQUIRED)))
def test_required_calls_read_the_same_however_the_reply_is_split(text, expected):
    check_every_split(RequiredCallsParser, text, expected)


@pytest.mark.parametrize("text, arguments", [('{"city": "Oslo"}', '{"city": "Oslo"}'),
                                             (' \n{"a": "b c "} \n', '{"a": "b c "}'), ("", "")])
def test_a_named_call_is_the_whole_output(text, arguments):
    check_every_split(lambda: NamedCallParser("f"), text, ("", [("f", arguments)]))


# Replies with tool calls

def test_required_tool_choice_returns_tool_calls(client, service):
    service.reply = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    r = chat(client, tools=TOOLS, tool_choice="required")
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    spec = service.submitted[0].params.structured_outputs
    assert json.loads(spec.json) == required_schema((Tool(0, "get_weather", WEATHER, {}), Tool(1, "get_time", None, {})))
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(service.submitted[1].params.structured_outputs.json)["maxItems"] == 1
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_a_named_tool_choice_returns_that_call(client, service):
    service.reply = '{"city": "Oslo", "unit": "c"}'
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": service.reply}
    assert json.loads(service.submitted[0].params.structured_outputs.json) == WEATHER | CALL_LAYOUT
    chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(service.submitted[1].params.structured_outputs.json) == NO_PARAMETERS | CALL_LAYOUT


def test_a_reply_cut_by_max_tokens_keeps_its_finish_reason(client, service):
    service.reply = '{"city": "Oslo", "unit": "c"}'
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=5)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"cit'


def test_auto_tool_choice_reads_hermes_calls(client, service):
    service.reply = HERMES[0][0]
    r = chat(client, tools=TOOLS)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        HERMES[0][1][1]
    assert service.submitted[0].params.structured_outputs is None
    service.reply = "Just text."
    r = chat(client, tools=TOOLS, tool_choice="auto")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Just text."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def sse_chunks(response):
    return [json.loads(block[6:]) for block in response.text.split("\n\n")
            if block.startswith("data: {")]


def test_streamed_tool_call_chunks_have_openais_shape(client, service):
    service.reply = HERMES[0][0]
    r = chat(client, tools=TOOLS, stream=True)
    chunks = sse_chunks(r)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    firsts = [e for e in entries if "id" in e]
    assert [(e["index"], e["type"], e["function"]["name"]) for e in firsts] == [(0, "function", "get_weather"),
                                                                               (1, "function", "get_time")]
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
               for e in entries if "id" not in e)
    assert len([e for e in entries if e["index"] == 0]) > 5  # the arguments stream as they are written
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def served():
    service = FakeService(max_model_len=4096)
    with live_server(create_app(service, model_name="m", tool_call_parser="hermes")) as url:
        yield service, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


STRICT_TOOLS = [{"type": "function", "function": t["function"] | {"strict": True,
                                                                   "parameters": t["function"].get("parameters", NO_PARAMETERS)}}
                for t in TOOLS]


@pytest.mark.parametrize("reply, tool_choice, expected", [
    (HERMES[0][0], "auto", HERMES[0][1][1]),
    (REQUIRED[0][0].replace('"a"', '"get_weather"').replace('"b"', '"get_time"').replace('"x": 1', '"city": "Rome"'),
     "required", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]),
    ('{"city": "Oslo"}', {"type": "function", "function": {"name": "get_weather"}}, [("get_weather", '{"city": "Oslo"}')]),
])
def test_the_openai_clients_stream_helper_reassembles_the_calls(served, reply, tool_choice, expected):
    service, client = served
    service.reply = reply
    whole = client.chat.completions.create(model="m", messages=USER, tools=STRICT_TOOLS, tool_choice=tool_choice)
    with client.chat.completions.stream(model="m", messages=USER, tools=STRICT_TOOLS,
                                        tool_choice=tool_choice) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    for completion in (whole, final):
        (choice,) = completion.choices
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == expected
    assert [json.loads(a) for _, a in expected] == \
        [c.function.parsed_arguments for c in final.choices[0].message.tool_calls]  # strict tools are parsed
    assert events.count("tool_calls.function.arguments.done") == len(expected)
    raw = list(client.chat.completions.create(model="m", messages=USER, tools=STRICT_TOOLS, tool_choice=tool_choice,
                                              stream=True))
    first = next(c for c in raw if c.choices and c.choices[0].delta.tool_calls).choices[0].delta.tool_calls[0]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == expected[0][0]


# Nothing the client sends makes a 500

values = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                      max_leaves=8)
fields = st.sampled_from(["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar", "guided_decoding_backend", "tools", "tool_choice"])
near = st.sampled_from([{"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
                        {"regex": "[a-z]"}, TOOLS, [TOOLS[0] | {"function": {"name": 1}}], "required", "auto",
                        {"type": "function", "function": {"name": "get_time"}}, {"json": {"type": "string"}}])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(fields, values | near, max_size=3))
def test_any_value_of_these_fields_is_answered_200_or_400(client, service, body):
    service.reply = "[]"
    for endpoint in (chat, complete):
        r = endpoint(client, **body)
        assert r.status_code in (200, 400), (body, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["param"]
    assert not service.live
