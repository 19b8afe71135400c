"""Structured outputs and tool calls end to end: the official openai client against the real
engine service on the default model (SmolLM2-135M-Instruct, one CPU device), served by
uvicorn on loopback. A dozen JSON schemas of growing difficulty, whole and streamed, each
answer parsed and validated with jsonschema; any JSON object; required and named tool
choices, whose arguments validate against the tool's parameters; a regex and a choice on
both endpoints; and a constraint the engine cannot compile, refused by the client's field.
Greedy, so that every answer completes its grammar well within max_tokens (strings carry a
maxLength and numbers bounds, so that no minimal answer is long)."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from http_live_server import live_server
from shiftjax.serving.server.http_server import create_app

MODEL = "smollm2-135m"
MAX_TOKENS = 200

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    ("a capital city", {"type": "object", "properties": {"city": NAME}, "required": ["city"],
                        "additionalProperties": False}),
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a light switch", {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                        "additionalProperties": False}),
    ("a colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"], "additionalProperties": False}),
    ("a measurement", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 50},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["celsius", "count"], "additionalProperties": False}),
    ("a list of fruit", {"type": "object", "properties": {"fruit": {
        "type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}},
        "required": ["fruit"], "additionalProperties": False}),
    ("an address", {"type": "object", "properties": {"person": {
        "type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False}),
    ("an id or a code", {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 999}, {"type": "string", "maxLength": 6}]}},
        "required": ["value"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {
        "kind": {"const": "event"}, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "note": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["kind", "date", "note"], "additionalProperties": False}),
    ("a short line", {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "label": {"type": "string", "maxLength": 8}},
            "required": ["id", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("some digits", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 4}),
]
WEATHER = {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]


class Book(BaseModel):
    title: str = Field(max_length=20)
    year: int = Field(ge=1500, le=2030)


def ask(what: str) -> list[dict]:
    return [{"role": "system", "content": "You answer in JSON only."},
            {"role": "user", "content": f"Give me {what} as JSON."}]


REGEX, CHOICES = "[A-Z][a-z]{2,9}", ["yes", "no"]
STRICT_TOOLS = [{"type": "function", "function": tool["function"] | {"strict": True}} for tool in TOOLS]
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
# tool_choice "auto" reads Hermes calls out of the text; the default model's template has no
# tool format, so a regex makes it write one: the real reply, token by token, through the parser
HERMES_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def served():
    import shiftjax
    from shiftjax.serving.server.service import AsyncEngineService

    # One device, and the module's 40 requests in one batch of 40 rows, so that it takes as
    # many steps as its longest answer; two buckets only (each costs ~15 s to compile on
    # this 2-core CPU). Unrolled layers: 2.5x faster steps than the scan (300 vs 750 ms for
    # 8 rows) for ~10 s more compiling.
    # 400 usable pages: 160 tokens a row for all 40 at once, more than these prompts and
    # answers take (the fallback, 801, lets each row reach max_model_len). Even unrolled, a
    # CPU step's time grows with the pool: 0.52 s at 801 pages, 0.27 at 161, for 8 rows.
    llm = shiftjax.LLM("default", dtype="float32", max_model_len=320, max_num_seqs=40, max_num_batched_tokens=256,
                       token_buckets=(40, 256), seq_buckets=(40,), mode="tp", layer_loop="unrolled",
                       num_pages=401)
    service = AsyncEngineService(llm.engine, llm.tokenizer, model_name=MODEL)
    service.wait_ready(600.0)
    with live_server(create_app(service, model_name=MODEL, tool_call_parser="hermes")) as url:
        yield url
    service.shutdown()


async def whole(create, **request) -> tuple[str, str]:
    choice = (await create(**request)).choices[0]
    return (choice.message.content if hasattr(choice, "message") else choice.text), choice.finish_reason


async def streamed(create, **request) -> tuple[str, str]:
    text, finish = "", None
    async for chunk in await create(**request, stream=True):
        if chunk.choices:
            choice = chunk.choices[0]
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            finish = choice.finish_reason or finish
    return text, finish


def requests(client) -> dict:
    """Every request of the module, by name: coroutines, run together."""
    chat, complete = client.chat.completions.create, client.completions.create
    greedy = dict(model=MODEL, temperature=0, max_tokens=MAX_TOKENS)
    out = {}
    for i, (what, schema) in enumerate(SCHEMAS):
        format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        out[f"schema {i}"] = whole(chat, messages=ask(what), response_format=format_, **greedy)
        out[f"schema {i} streamed"] = streamed(chat, messages=ask(what), response_format=format_, **greedy)
    capital_json = ask("the capital of France")  # any object would do; this one's answer is short
    out["object"] = whole(chat, messages=capital_json, response_format={"type": "json_object"}, **greedy)
    out["object streamed"] = streamed(chat, messages=capital_json, response_format={"type": "json_object"}, **greedy)
    capital = [{"role": "user", "content": "What is the capital of France? One word."}]
    out["regex"] = whole(chat, messages=capital, extra_body={"structured_outputs": {"regex": REGEX}}, **greedy)
    out["regex streamed"] = streamed(chat, messages=capital, extra_body={"guided_regex": REGEX}, **greedy)
    yes_no = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    out["choice"] = whole(chat, messages=yes_no, extra_body={"structured_outputs": {"choice": CHOICES}}, **greedy)
    out["completion regex"] = whole(complete, prompt="The capital of France is", extra_body={"guided_regex": REGEX},
                                    **greedy)
    out["completion choice"] = streamed(complete, prompt="Is Paris in France?", extra_body={"guided_choice": CHOICES},
                                        **greedy)
    out["completion schema"] = whole(complete, prompt="A person as JSON: ", **greedy, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS[1][1]}}})
    out["pydantic"] = client.chat.completions.parse(model=MODEL, messages=ask("a book"), response_format=Book,
                                                    temperature=0, max_tokens=MAX_TOKENS)
    tools = dict(greedy, messages=TOOL_QUESTION, tools=STRICT_TOOLS)

    async def calls_streamed(**extra):
        async with client.chat.completions.stream(**tools, **extra) as stream:
            async for _ in stream:
                pass
            return await stream.get_final_completion()

    out["required"] = chat(**tools, tool_choice="required")
    out["required streamed"] = calls_streamed(tool_choice="required")
    out["required, one"] = chat(**tools, tool_choice="required", parallel_tool_calls=False)
    out["named"] = chat(**tools, tool_choice=NAMED)
    out["named streamed"] = calls_streamed(tool_choice=NAMED)
    hermes = {"structured_outputs": {"regex": HERMES_CALL}}
    out["auto"] = chat(**tools, tool_choice="auto", extra_body=hermes)
    out["auto streamed"] = calls_streamed(tool_choice="auto", extra_body=hermes)
    return out


@pytest.fixture(scope="module")
def answers(served) -> dict:
    """Each request's reply (or the exception it raised), by name."""
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            named = requests(client)
            results = await asyncio.gather(*named.values(), return_exceptions=True)
            return dict(zip(named, results))
    return asyncio.run(main())


def answer(answers, name):
    result = answers[name]
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.mark.parametrize("i", range(len(SCHEMAS)), ids=[what for what, _ in SCHEMAS])
def test_json_schemas_whole_and_streamed(answers, i):
    what, schema = SCHEMAS[i]
    for name in (f"schema {i}", f"schema {i} streamed"):
        text, finish = answer(answers, name)
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_objects_regexes_choices_and_pydantic_models(answers):
    for name in ("object", "object streamed", "regex", "regex streamed", "choice", "completion regex",
                 "completion choice", "completion schema"):
        text, finish = answer(answers, name)
        assert finish == "stop", (name, text)
    for name in ("object", "object streamed"):
        assert isinstance(json.loads(answer(answers, name)[0]), dict)
    for name in ("regex", "regex streamed", "completion regex"):
        assert re.fullmatch(REGEX, answer(answers, name)[0]), name
    assert answer(answers, "choice")[0] in CHOICES and answer(answers, "completion choice")[0] in CHOICES
    jsonschema.validate(json.loads(answer(answers, "completion schema")[0]), SCHEMAS[1][1])
    book = answer(answers, "pydantic").choices[0].message.parsed
    assert isinstance(book, Book) and 1500 <= book.year <= 2030


@pytest.mark.parametrize("name", ["required", "required streamed", "required, one", "named", "named streamed",
                                  "auto", "auto streamed"])
def test_tool_choices_return_calls_that_fit_their_parameters(answers, name):
    (choice,) = answer(answers, name).choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    calls = choice.message.tool_calls
    assert calls and len({call.id for call in calls}) == len(calls)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if name.startswith(("named", "auto")):
        assert [call.function.name for call in calls] == ["get_time"]
    if name == "required, one":
        assert len(calls) == 1


def test_a_constraint_the_engine_cannot_compile_is_refused_by_its_field(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                 "properties": {"a": {"type": "foo"}}}}}
    for fields, param in [({"guided_regex": "(("}, "guided_regex"),
                          ({"response_format": bad_schema}, "response_format.json_schema.schema"),
                          ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=5, extra_body=fields)
        assert error.value.param == param, error.value
