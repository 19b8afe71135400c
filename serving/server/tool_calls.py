"""A chat reply read back into tool calls, whole or as it streams.

Three readers, one per way a request asks for tools (``openai_structured.OutputPlan``):

- :class:`NamedCallParser`: ``tool_choice`` names a function, and the output, held to that
  function's parameters schema, is its arguments: one call.
- :class:`RequiredCallsParser`: ``tool_choice: "required"``; the output, held to
  ``openai_structured.required_schema``, is a JSON array of ``{"name", "parameters"}``.
- :class:`HermesParser` (``--tool-call-parser hermes``): ``tool_choice: "auto"``, nothing
  forced; the calls are read out of the text where the model wrote them as Hermes and
  Qwen2.5 chat templates teach, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  and the text around them is the message's content.

Each is fed the reply's text delta by delta and says what each adds: a :class:`Step` of
content and :class:`CallDelta` s (a call's first carries its id and name, the later ones
append to its arguments, as OpenAI streams them). Arguments stream as the model writes
them, cut where their JSON value ends (a scan that tracks strings and nesting). A reply read
whole is the same parser fed once (:func:`parse_whole`): streamed or not, and however it
was split, a reply reads the same.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string

_ALPHABET = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"
_LITERAL = frozenset("0123456789+-.eE" "truefalsn")  # numbers, true, false, null
# How a call object begins, to where its arguments' value starts: once this matches, the
# name is known and the arguments stream. (The lookahead makes the match the same on every
# longer text, so where a reply was split cannot change it.)
_CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


def new_call_id() -> str:
    """A tool call's id, as OpenAI spells them: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclasses.dataclass
class CallDelta:
    """Part of tool call ``index``: its first carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_json(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class Step:
    """What one delta of the reply adds: content text and parts of tool calls."""

    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)

    def start(self, index: int, name: str) -> None:
        self.calls.append(CallDelta(index, new_call_id(), name))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(CallDelta(index, arguments=text))

    def merge(self, later: "Step") -> "Step":
        self.content += later.content
        for delta in later.calls:
            self.calls.append(delta) if delta.id is not None else self.arguments(delta.index, delta.arguments)
        return self


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallParser:
    """Reads one reply; ``feed`` each text delta, then ``finish`` once. ``forced``: the
    output is wholly tool calls (a grammar made it so); ``max_calls`` (1 for
    ``parallel_tool_calls: false``) drops the calls past it."""

    forced = False

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.count = 0  # calls started
        self._pending = ""  # text not yet read (the text readers')
        self._state = ""
        self._arguments: _ValueEnd | None = None
        self._current: int | None = None  # the call whose arguments stream (None: past max_calls)

    def _start(self, out: Step, name: str) -> int | None:
        if self.max_calls is not None and self.count >= self.max_calls:
            return None
        out.start(self.count, name)
        self.count += 1
        return self.count - 1

    def _begin(self, out: Step, match: re.Match) -> None:
        """Starts the call whose object begins with ``match`` (a :data:`_CALL_PREFIX`)."""
        try:
            name = json.loads(match[1])
        except ValueError:
            name = match[1][1:-1]
        self._current = self._start(out, name)
        self._pending, self._arguments, self._state = self._pending[match.end():], _ValueEnd(), "arguments"

    def _read_arguments(self, out: Step) -> bool:
        """Streams what is pending of the arguments; whether their value has ended."""
        n = self._arguments.feed(self._pending)
        if self._current is not None:
            out.arguments(self._current, self._pending[:n])
        self._pending = self._pending[n:]
        return self._arguments.done


def parse_whole(parser: CallParser, text: str) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a whole reply."""
    return assemble([parser.feed(text), parser.finish()])


def assemble(steps: list[Step]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that ``steps`` stream, put together as a client does."""
    content, calls = "", {}
    for step in steps:
        content += step.content
        for delta in step.calls:
            if delta.id is not None:
                calls[delta.index] = [delta.id, delta.name, delta.arguments]
            else:
                calls[delta.index][2] += delta.arguments
    return content, [ToolCall(*calls[i]) for i in sorted(calls)]


class NamedCallParser(CallParser):
    """The whole output is the arguments of the function ``name`` (whitespace around it cut)."""

    forced = True

    def __init__(self, name: str):
        super().__init__(1)
        self.name = name
        self._held = ""  # trailing whitespace, written only if more follows
        self._leading = True

    def feed(self, text: str) -> Step:
        out = Step()
        if self.count == 0:
            self._start(out, self.name)
        if self._leading:
            text = text.lstrip(_WHITESPACE)
            self._leading = not text
        body, self._held = _held_back(self._held + text)
        out.arguments(0, body)
        return out

    def finish(self) -> Step:
        out = Step()
        if self.count == 0:
            self._start(out, self.name)
        return out


class RequiredCallsParser(CallParser):
    """The output is a JSON array of ``{"name": ..., "parameters": {...}}`` (``arguments``
    read too). One that is not (under its grammar, only when cut by ``max_tokens``) gives
    what calls can be read of it whole and, with none, its text as content."""

    forced = True

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._text, self._state = "", "open"
        self._rest: _ValueEnd | None = None

    def feed(self, text: str) -> Step:
        out = Step()
        self._text += text
        self._pending += text
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> Step:
        out = Step()
        if self._state in ("prefix", "fallback"):
            self._read_whole(out)
        if self.count == 0:
            out.content = self._text
        return out

    def _step(self, out: Step) -> bool:
        """Reads on in the current state; False when it needs more text."""
        if self._state in ("open", "between"):
            self._pending = self._pending.lstrip(_WHITESPACE)
            if not self._pending:
                return False
            c, self._pending = self._pending[0], self._pending[1:]
            if self._state == "open":
                self._state = "between" if c == "[" else "fallback"
            elif c == "{":
                self._pending, self._state = "{" + self._pending, "prefix"
            elif c == "]":
                self._state = "done"
            elif c != ",":
                self._state = "fallback"
        elif self._state == "prefix":
            if (match := _CALL_PREFIX.match(self._pending)) is None:
                return False  # not yet; an object that never begins so is read whole at the end
            self._begin(out, match)
        elif self._state == "arguments":
            if self._read_arguments(out):
                self._rest, self._state = _ValueEnd(depth=1), "rest"  # the rest of the call's object
        elif self._state == "rest":
            self._pending = self._pending[self._rest.feed(self._pending):]
            if self._rest.done:
                self._state = "between"
        else:  # "fallback" (read whole at the end) or "done"
            self._pending = ""
        return True

    def _read_whole(self, out: Step) -> None:
        try:
            items = json.loads(self._text)
        except ValueError:
            return
        for item in (items if isinstance(items, list) else [])[self.count:]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                index = self._start(out, item["name"])
                if index is not None:
                    out.arguments(index, _arguments_text(item))


class HermesParser(CallParser):
    """Tool calls in ``<tool_call>...</tool_call>`` blocks of a JSON object with ``name``
    and ``arguments``, what Hermes and Qwen2.5 chat templates teach. The text outside the
    blocks is content; whitespace that only separates it from the blocks is dropped. A block
    whose object does not begin ``{"name": ..., "arguments": ...`` is read when it closes:
    a JSON object with a ``name`` is a call, anything else stays in the content as written."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._state = "text"
        self._held = ""  # content's trailing whitespace: written when more content follows

    def feed(self, text: str) -> Step:
        out = Step()
        self._pending += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Step:
        out = Step()
        while self._step(out, final=True):
            pass
        if self.count == 0:
            out.content += self._held
        self._held = ""
        return out

    def _step(self, out: Step, final: bool) -> bool:
        """Reads on in the current state; False when it needs more text."""
        if self._state == "text":
            at = self._pending.find(self.START)
            if at < 0:
                cut = len(self._pending) - (0 if final else _partial_suffix(self._pending, self.START))
                self._content(out, self._pending[:cut])
                self._pending = self._pending[cut:]
                return False
            self._content(out, self._pending[:at])
            self._held = ""
            self._pending, self._state = self._pending[at + len(self.START):], "prefix"
        elif self._state == "prefix":
            close = self._pending.find(self.END)
            block = self._pending if close < 0 else self._pending[:close]
            if (match := _CALL_PREFIX.match(block)) is not None:
                self._begin(out, match)
            elif close >= 0 or final:
                self._whole_block(out, block, closed=close >= 0)
                self._pending = self._pending[close + len(self.END):] if close >= 0 else ""
                self._state = "text"
            else:
                return False
        elif self._state == "arguments":
            if not self._read_arguments(out):
                return False
            self._state = "after"
        else:  # "after" the arguments: the rest of the block, dropped, to its closing tag
            close = self._pending.find(self.END)
            if close < 0:
                self._pending = self._pending[len(self._pending) - _partial_suffix(self._pending, self.END):]
                return False
            self._pending, self._state = self._pending[close + len(self.END):], "text"
        return True

    def _content(self, out: Step, text: str) -> None:
        body, self._held = _held_back(self._held + text)
        out.content += body

    def _whole_block(self, out: Step, block: str, closed: bool) -> None:
        try:
            call = json.loads(block)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            index = self._start(out, call["name"])
            if index is not None:
                out.arguments(index, _arguments_text(call))
        else:
            self._content(out, self.START + block + (self.END if closed else ""))


PARSERS = {"hermes": HermesParser}  # --tool-call-parser NAME


def _arguments_text(call: dict) -> str:
    # a string is written as JSON too (a JSON string), as it streams, and as vLLM writes it
    return json.dumps(call.get("arguments", call.get("parameters", {})), ensure_ascii=False)


class _ValueEnd:
    """Where one JSON value ends, fed its text piece by piece from its first character
    (``depth=1``: from inside an object or array, which then ends it)."""

    def __init__(self, depth: int = 0):
        self.depth, self.kind = depth, "container" if depth else None
        self.in_string = self.escape = self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value: all, unless it ends within
        ``text`` (then ``done``)."""
        for i, c in enumerate(text):
            if self.kind is None:  # the first character says what the value is
                self.kind = "container" if c in "{[" else "string" if c == '"' else "literal"
                self.depth, self.in_string = int(c in "{["), c == '"'
                if self.kind != "literal":
                    continue
            if self.in_string:
                if c == '"' and not self.escape:
                    self.in_string = False
                    if self.kind == "string":
                        return self._end(i + 1)
                self.escape = not self.escape and c == "\\"
            elif self.kind == "literal":
                if c not in _LITERAL:  # (at the first character: not a JSON value at all)
                    return self._end(i)
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
            elif c == "<":  # markup outside a string: the model left the JSON (a closing tag)
                return self._end(i)
        return len(text)

    def _end(self, length: int) -> int:
        self.done = True
        return length


def _held_back(text: str) -> tuple[str, str]:
    """``text`` cut before its trailing whitespace, and that whitespace (held: written only
    when more text follows)."""
    body = text.rstrip(_WHITESPACE)
    return body, text[len(body):]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag split across deltas)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
