"""The OpenAI API's structured-output and tool fields, read into what the engine takes.

A request may constrain its output in one way: ``response_format`` (``json_object`` or
``json_schema``), vLLM's ``structured_outputs`` object or its older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``, or a ``tool_choice`` that forces
tool calls (``"required"``, or a named function). :func:`output_plan` reads them all into one
:class:`OutputPlan`: the engine's :class:`StructuredOutputs`, the field it came from (an
engine error naming ``structured_outputs.<kind>`` is renamed to it), and how the reply is
read back into ``message.tool_calls`` (``tool_calls.py``). Two constraints at once are a 400
naming both, as are a malformed schema, tool or tool choice: every rule names the field as
the client spelled it (``response_format.json_schema.schema``, ``tools.0.function.name``).

Whether a schema or regex compiles is the engine's word: :func:`check_constraint` has the
service compile it (``check_structured_outputs``, on a pool thread, before ``submit``: the
compiled grammar travels in ``GenerationRequest.grammar``) and renames its refusal.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.structured_outputs import KINDS, StructuredOutputs
from shiftjax.serving.server import tool_calls
from shiftjax.serving.server.validation import field_path, shown

MAX_TOOLS = 128  # OpenAI's limit
# vLLM's names of its grammar backends; this server compiles every constraint with llguidance
# (vLLM's "guidance"), so only that one, or "auto", is accepted
GUIDED_BACKENDS = ("auto", "llguidance", "guidance")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# the arguments schema of a function declared without parameters: an empty object
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# llguidance's options for the schemas of forced tool calls: JSON as json.dumps writes it. By
# default a JSON schema allows any whitespace between tokens, and the default model, forced
# to call a tool at temperature 1, wrote arguments of a dozen blank lines, cut by max_tokens.
# (A client's own schemas are left as it sent them.)
CALL_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@dataclasses.dataclass(frozen=True)
class Tool:
    """One function of a request's ``tools``, checked; ``spec`` is the tool as the client
    sent it (what a chat template renders)."""

    index: int
    name: str
    parameters: dict | None
    spec: dict

    @property
    def arguments_schema(self) -> dict:
        return NO_PARAMETERS if self.parameters is None else self.parameters


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """What a request asks of its output: ``structured_outputs`` for the engine (None: free
    text) and ``field``, where the request gave it; ``tool_choice`` (``"none"``, ``"auto"``,
    ``"required"`` or ``"function"``, then ``function`` names it) over ``tools``; and
    ``parser``, the server's ``--tool-call-parser`` that reads ``"auto"`` replies."""

    structured_outputs: StructuredOutputs | None = None
    field: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"
    function: str | None = None
    parallel_tool_calls: bool = True
    parser: str | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools as a chat template takes them (``tools=``), None without any."""
        return [tool.spec for tool in self.tools] or None

    def call_parser(self) -> tool_calls.CallParser | None:
        """A fresh parser of this request's reply into tool calls; None: the reply is text."""
        limit = None if self.parallel_tool_calls else 1
        if self.tool_choice == "function":
            return tool_calls.NamedCallParser(self.function)
        if self.tool_choice == "required":
            return tool_calls.RequiredCallsParser(max_calls=limit)
        if self.tool_choice == "auto":
            return tool_calls.PARSERS[self.parser](max_calls=limit)
        return None

    def renamed(self, error: InvalidRequest) -> InvalidRequest:
        """``error`` with the engine's ``structured_outputs...`` field replaced by this plan's."""
        if self.field is None or error.field == self.field or not (
                error.field == "structured_outputs" or error.field.startswith("structured_outputs.")):
            return error
        return InvalidRequest(self.field, str(error).removeprefix(f"{error.field}: "))


def output_plan(request, parser: str | None = None) -> OutputPlan:
    """The :class:`OutputPlan` of a parsed ``CompletionRequest`` or ``ChatCompletionRequest``
    (``openai_schema``); ``parser`` is the server's tool-call parser (``tool_calls.PARSERS``).
    Raises :class:`InvalidRequest` naming the first bad field."""
    constraints = []  # (the field it came from, the field an engine error is renamed to, spec)
    if (found := response_format(request.response_format)) is not None:
        constraints.append(("response_format", *found))
    if request.structured_outputs is not None:
        constraints.append(("structured_outputs", *structured_outputs(request.structured_outputs)))
    for name, kind in GUIDED_FIELDS.items():
        if (value := getattr(request, name)) is not None:
            constraints.append((name, name, _spec(kind, value, name)))
    backend = request.guided_decoding_backend
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise InvalidRequest("guided_decoding_backend", f"must be 'auto' or 'llguidance' (this server compiles "
                                                        f"every constraint with llguidance), got {shown(backend)}")
    tools = read_tools(getattr(request, "tools", None))
    choice, function = read_tool_choice(getattr(request, "tool_choice", None), tools, parser)
    parallel = getattr(request, "parallel_tool_calls", None) is not False
    if choice == "required":
        constraints.append(("tool_choice", "tools", StructuredOutputs.from_json_schema(required_schema(tools, parallel))))
    elif choice == "function":
        tool = next(t for t in tools if t.name == function)
        constraints.append(("tool_choice", f"tools.{tool.index}.function.parameters",
                            StructuredOutputs.from_json_schema(tool.arguments_schema | CALL_LAYOUT)))
    if len(constraints) > 1:
        names = [given for given, _, _ in constraints]
        raise InvalidRequest(names[1], f"{' and '.join(names)} each constrain the output; give one of them")
    spec, field = (constraints[0][2], constraints[0][1]) if constraints else (None, None)
    return OutputPlan(structured_outputs=spec, field=field, tools=tools, tool_choice=choice, function=function,
                      parallel_tool_calls=parallel, parser=parser)


def check_constraint(service, params, plan: OutputPlan):
    """``params``' constraint compiled by the service (on the caller's thread: a pool's), for
    ``GenerationRequest.grammar`` (None without one); a refusal is renamed to the request's
    field. For ``tool_choice: "required"``, whose schema joins every tool's, the tool whose
    parameters do not compile is named."""
    if params.structured_outputs is None:
        return None
    try:
        return service.check_structured_outputs(params)
    except InvalidRequest as error:
        if plan.tool_choice == "required":
            for tool in plan.tools:
                alone = dataclasses.replace(params, structured_outputs=StructuredOutputs.from_json_schema(
                    tool.arguments_schema))
                try:
                    service.check_structured_outputs(alone)
                except InvalidRequest as tool_error:
                    field = f"tools.{tool.index}.function.parameters"
                    raise InvalidRequest(field, str(tool_error).removeprefix(f"{tool_error.field}: ")) from None
        raise plan.renamed(error) from None


def response_format(value) -> tuple[str, StructuredOutputs] | None:
    """``response_format`` as (the field of its schema, its constraint); None for text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("response_format", f"must be an object such as {{'type': 'json_object'}}, "
                                                f"got {shown(value)}")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("response_format.type", f"must be 'text', 'json_object' or 'json_schema', "
                                                     f"got {shown(kind)}")
    _only_keys(value, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutputs(json_object=True)
    spec = value.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(field, "is required with type 'json_schema': an object with a 'name' and a 'schema'")
    _only_keys(spec, ("name", "description", "schema", "strict"), field)
    _typed(spec, "name", str, field, "a string", required=True)
    _typed(spec, "description", str, field, "a string")
    _typed(spec, "strict", bool, field, "a bool")
    if "schema" not in spec:
        raise InvalidRequest(f"{field}.schema", "is required: the JSON schema the output must match")
    return f"{field}.schema", _json_schema(spec["schema"], f"{field}.schema")


def structured_outputs(value) -> tuple[str, StructuredOutputs]:
    """vLLM's ``structured_outputs`` object: exactly one of ``json``, ``json_object``,
    ``regex``, ``choice``, ``grammar``."""
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs", f"must be an object with one of {', '.join(KINDS)}, "
                                                   f"got {shown(value)}")
    _only_keys(value, KINDS, "structured_outputs")
    given = [kind for kind in KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest("structured_outputs", f"give exactly one of {', '.join(KINDS)}, got "
                                                   f"{', '.join(given) or 'none'}")
    (kind,) = given
    field = f"structured_outputs.{kind}"
    return field, _spec(kind, value[kind], field)


def _spec(kind: str, value, field: str) -> StructuredOutputs:
    if kind == "json":
        if isinstance(value, str):
            return _renamed(lambda: StructuredOutputs(json=value), field)
        return _json_schema(value, field)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(field, f"must be true, got {shown(value)}")
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(field, f"must be a non-empty list of non-empty strings, got {shown(value)}")
        return _renamed(lambda: StructuredOutputs(choice=tuple(value)), field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(field, f"must be a non-empty string, got {shown(value)}")
    return _renamed(lambda: StructuredOutputs(**{kind: value}), field)


def _json_schema(schema, field: str) -> StructuredOutputs:
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(field, f"must be a JSON schema (an object), got {shown(schema)}")
    # (its properties keep their order: llguidance writes them in the order declared)
    return _renamed(lambda: StructuredOutputs.from_json_schema(schema), field)


def _renamed(make, field: str) -> StructuredOutputs:
    try:
        return make()
    except InvalidRequest as error:
        raise InvalidRequest(field, str(error).removeprefix(f"{error.field}: ")) from None


def read_tools(value) -> tuple[Tool, ...]:
    """``tools``: OpenAI function tools, each checked."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest("tools", "must be a list of tools such as {'type': 'function', 'function': "
                                      f"{{'name': ..., 'parameters': {{...}}}}}}, got {shown(value)}")
    if len(value) > MAX_TOOLS:
        raise InvalidRequest("tools", f"has {len(value)} tools; give at most {MAX_TOOLS}")
    tools, seen = [], {}
    for i, spec in enumerate(value):
        field = f"tools.{i}"
        if not isinstance(spec, dict):
            raise InvalidRequest(field, f"must be an object {{'type': 'function', 'function': {{...}}}}, "
                                        f"got {shown(spec)}")
        _only_keys(spec, ("type", "function"), field)
        if spec.get("type") != "function":
            raise InvalidRequest(f"{field}.type", f"must be 'function' (the only kind of tool this server "
                                                  f"implements), got {shown(spec.get('type'))}")
        function = spec.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{field}.function", "is required: an object with a 'name' and, optionally, "
                                                      "a 'description' and 'parameters' (a JSON schema)")
        _only_keys(function, ("name", "description", "parameters", "strict"), f"{field}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{field}.function.name", f"is required: a non-empty string, got {shown(name)}")
        if name in seen:
            raise InvalidRequest(f"{field}.function.name", f"repeats the name of tools.{seen[name]}; "
                                                           "give each tool its own")
        seen[name] = i
        _typed(function, "description", str, f"{field}.function", "a string")
        _typed(function, "strict", bool, f"{field}.function", "a bool")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"{field}.function.parameters", "must be a JSON schema object such as "
                                                                 "{'type': 'object', 'properties': {...}}, "
                                                                 f"got {shown(parameters)}")
        tools.append(Tool(index=i, name=name, parameters=parameters, spec=spec))
    return tuple(tools)


def read_tool_choice(value, tools: tuple[Tool, ...], parser: str | None) -> tuple[str, str | None]:
    """``tool_choice`` as (``"none"``, ``"auto"``, ``"required"`` or ``"function"``, the named
    function). Absent, it is ``"auto"`` with tools and ``"none"`` without, as in OpenAI's API;
    ``"auto"`` needs a tool-call parser (vLLM refuses it without ``--tool-call-parser`` too)."""
    if value is None:
        if not tools:
            return "none", None
        value, field = "auto", "tools"  # the client sent tools, not this choice: name what it sent
    else:
        field = "tool_choice"
    if isinstance(value, dict):
        _only_keys(value, ("type", "function"), "tool_choice")
        if value.get("type") != "function":
            raise InvalidRequest("tool_choice.type", f"must be 'function', got {shown(value.get('type'))}")
        function = value.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest("tool_choice.function", "is required: an object {'name': ...}")
        _only_keys(function, ("name",), "tool_choice.function")
        name = function.get("name")
        if not isinstance(name, str) or name not in {tool.name for tool in tools}:
            known = ", ".join(repr(tool.name) for tool in tools) or "none are given"
            raise InvalidRequest("tool_choice.function.name", f"must name one of the tools ({known}), "
                                                              f"got {shown(name)}")
        return "function", name
    if value == "none":
        return "none", None
    if value not in ("auto", "required"):
        raise InvalidRequest("tool_choice", f"must be 'none', 'auto', 'required' or {{'type': 'function', "
                                            f"'function': {{'name': ...}}}}, got {shown(value)}")
    if not tools:
        raise InvalidRequest("tool_choice", f"is {value!r} but no tools are given; give tools, or leave "
                                            "tool_choice out")
    if value == "auto" and parser is None:
        raise InvalidRequest(field, "\"auto\" tool choice needs the server started with --tool-call-parser "
                                    f"(one of: {', '.join(tool_calls.PARSERS)}), which reads tool calls out of "
                                    "the model's text; send tool_choice \"none\", \"required\" or a named "
                                    "function instead")
    return value, None


def required_schema(tools: tuple[Tool, ...], parallel: bool = True) -> dict:
    """The JSON schema that ``tool_choice: "required"`` holds the output to, as vLLM's: an
    array of at least one ``{"name": <a tool's name>, "parameters": <its arguments>}``, one
    ``anyOf`` branch per tool. Each tool's ``$defs`` (and ``definitions``) move to the root,
    where its ``#/$defs/...`` references now point; two tools defining one name differently
    cannot share them, and are refused."""
    shared: dict[str, dict] = {}
    items = []
    for tool in tools:
        parameters = dict(tool.arguments_schema)
        for key in ("$defs", "definitions"):
            definitions = parameters.pop(key, None)
            if definitions is None:
                continue
            field = f"tools.{tool.index}.function.parameters.{key}"
            if not isinstance(definitions, dict):
                raise InvalidRequest(field, f"must be an object of named schemas, got {shown(definitions)}")
            into = shared.setdefault(key, {})
            for name, definition in definitions.items():
                if name in into and into[name] != definition:
                    raise InvalidRequest(f"{field}.{name}", "differs from another tool's definition of that name; "
                                                            "with tool_choice 'required' the tools' definitions "
                                                            "share one schema, so rename one")
                into[name] = definition
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema | shared | CALL_LAYOUT


def message_tool_calls(value, field: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as a chat template takes them: each
    ``{"id", "type": "function", "function": {"name", "arguments"}}``, with ``arguments``
    (a JSON string in the API) decoded when it is a JSON object, since templates write it
    with ``tojson`` (vLLM decodes it too)."""
    if not isinstance(value, list):
        raise InvalidRequest(field, f"must be a list of tool calls, got {shown(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{field}.{j}"
        if not isinstance(call, dict):
            raise InvalidRequest(at, f"must be an object {{'id', 'type', 'function'}}, got {shown(call)}")
        _only_keys(call, ("id", "type", "function"), at)
        _typed(call, "id", str, at, "a string", required=True)
        if call.get("type", "function") != "function":
            raise InvalidRequest(f"{at}.type", f"must be 'function', got {shown(call.get('type'))}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{at}.function", "is required: an object {'name', 'arguments'}")
        _only_keys(function, ("name", "arguments"), f"{at}.function")
        _typed(function, "name", str, f"{at}.function", "a string", required=True)
        _typed(function, "arguments", str, f"{at}.function", "a string (JSON text)", required=True)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = function["arguments"]
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _only_keys(value: dict, allowed, field: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidRequest(f"{field}.{field_path([key])}", f"unknown parameter; give only {', '.join(allowed)}")


def _typed(value: dict, key: str, kind: type, field: str, what: str, *, required: bool = False) -> None:
    got = value.get(key)
    if got is None and not required:
        return
    if not isinstance(got, kind) or (kind is str and required and not got):
        raise InvalidRequest(f"{field}.{key}", f"must be {what}{' (required)' if required else ''}, "
                                               f"got {shown(got)}")
