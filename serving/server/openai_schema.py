"""The OpenAI API's request bodies, and what they mean for the engine service.

Requests are pydantic models with ``extra="forbid"``: a parameter this server does not
know is a 400 naming it, never silently dropped. Parameters it knows but implements only
at their neutral value (``n``, ``best_of``, penalties, ``logit_bias``, ``echo``,
``suffix``) are accepted at that value and refused otherwise by
:func:`refuse_unimplemented`. The structured-output and tool fields (``response_format``,
``structured_outputs``, ``guided_*``, ``tools``, ``tool_choice``) are typed loosely here and
read, field by field, by ``openai_structured.py``. Responses are built as plain dicts in
``http_replies.py``; the logprob shapes of the two APIs are built here.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.server import validation
from shiftjax.serving.server.openai_structured import OutputPlan, message_tool_calls
from shiftjax.serving.server.protocol import TokenLogprob
from shiftjax.serving.server.validation import field_path, shown

# The OpenAI API's default for /v1/completions when max_tokens is not given.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool, as the OpenAI API answers
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """The fields both APIs share, vLLM's extensions included."""

    model: str | None = None  # optional here (the server has one model); checked when given
    max_tokens: int | None = None
    temperature: float | None = None  # None: the OpenAI default, 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own tracking; changes nothing
    # vLLM's extensions
    top_k: int | None = None  # 0 or -1 disables
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None  # prefix-cache pages shared only among requests of this salt
    # shiftjax's (vLLM has none): keep this request out of speculative decoding
    disable_speculation: bool = False
    # what the output must match (openai_structured.output_plan reads these; Any: it names
    # the nested field that is wrong, as the client spelled it)
    response_format: Any = None
    structured_outputs: Any = None  # vLLM's
    guided_json: Any = None  # vLLM's older spellings
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    # known, implemented only at their neutral value
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # this many alternatives per token (0 to 20)
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(_Strict):
    role: str  # validation.checked_chat_messages says which (gRPC's rule too)
    content: str | list[dict[str, Any]] | None = None
    tool_calls: Any = None  # an assistant's (openai_structured.message_tool_calls)
    tool_call_id: str | None = None  # a tool message's: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` as ``model``, or :class:`InvalidRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        loc = first["loc"]
        if first["type"] == "extra_forbidden":
            raise InvalidRequest(field_path(loc), "unknown parameter; this server does not implement it") from None
        if loc and loc[0] == "prompt":
            raise InvalidRequest("prompt", "must be a string, a list of token ids, a list of strings "
                                           "or a list of token-id lists") from None
        field = field_path(part for part in loc if not _is_union_tag(part))
        raise InvalidRequest(field or "body", f"{first['msg']} (got {shown(first.get('input'))})") from None


def _is_union_tag(part) -> bool:
    # pydantic names the union member an error came from ("str", "list[int]") in the location
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or "[" in part)


def refuse_unimplemented(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Raises :class:`InvalidRequest` for a known parameter set to a value this server
    does not implement."""
    def refuse(field, what):
        raise InvalidRequest(field, f"this server does not implement {what}, got {shown(getattr(request, field))}")

    if request.n != 1:
        refuse("n", "n > 1 (send the request n times, with different seeds)")
    if request.presence_penalty != 0:
        refuse("presence_penalty", "presence penalties (only 0)")
    if request.frequency_penalty != 0:
        refuse("frequency_penalty", "frequency penalties (only 0)")
    if request.logit_bias:
        refuse("logit_bias", "logit biases (only an empty or absent map)")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options", "is only allowed with stream=true")
    if isinstance(request, CompletionRequest):
        if request.best_of not in (None, 1):
            refuse("best_of", "best_of > 1")
        if request.echo:
            refuse("echo", "echo")
        if request.suffix:
            refuse("suffix", "suffix (insertion)")
    else:
        if request.max_tokens is not None and request.max_completion_tokens is not None \
                and request.max_tokens != request.max_completion_tokens:
            raise InvalidRequest("max_tokens", "differs from max_completion_tokens; give one of them")


def sampling_params(request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    logprobs: bool, top_logprobs: int, plan: OutputPlan | None = None) -> SamplingParams:
    """The engine's parameters for ``request``, constrained as ``plan`` says; an invalid
    value raises InvalidRequest naming the field as the request spelled it."""
    temperature = 1.0 if request.temperature is None else request.temperature
    seed = request.seed
    if seed is None:  # the OpenAI API samples afresh on every call unless a seed is given
        seed = secrets.randbelow(2**31)
    top_k = 0 if request.top_k is None else request.top_k
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    try:
        return validation.sampling_params(
            max_tokens=max_tokens, temperature=temperature,
            top_p=1.0 if request.top_p is None else request.top_p, top_k=top_k,
            min_p=0.0 if request.min_p is None else request.min_p, seed=seed,
            stop_token_ids=tuple(request.stop_token_ids or ()), stop=stop, ignore_eos=request.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs,
            structured_outputs=None if plan is None else plan.structured_outputs,
            disable_speculation=request.disable_speculation)
    except InvalidRequest as error:
        raise rename_field(error, request, plan) from None


def rename_field(error: InvalidRequest, request: CompletionRequest | ChatCompletionRequest,
                 plan: OutputPlan | None = None) -> InvalidRequest:
    """``error`` with the engine's field name replaced by the one the request used."""
    if plan is not None:
        error = plan.renamed(error)
    field = error.field
    if field == "prompt_ids":
        field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    elif field == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        field = "max_completion_tokens"
    elif field == "top_logprobs" and isinstance(request, CompletionRequest):
        field = "logprobs"
    if field == error.field:
        return error
    message = str(error).removeprefix(f"{error.field}: ")
    return InvalidRequest(field, message)


def chat_messages(request: ChatCompletionRequest) -> list[dict]:
    """The messages as a chat template takes them: text content only (text parts joined), an
    assistant's ``tool_calls`` and a tool message's ``tool_call_id``."""
    messages = []
    for i, message in enumerate(request.messages):
        extra = {}
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise InvalidRequest(f"messages.{i}.tool_calls", "only an assistant message carries tool calls")
            extra["tool_calls"] = message_tool_calls(message.tool_calls, f"messages.{i}.tool_calls")
        if message.tool_call_id is not None:
            if message.role != "tool":
                raise InvalidRequest(f"messages.{i}.tool_call_id", "only a tool message answers a tool call")
            extra["tool_call_id"] = message.tool_call_id
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                    raise InvalidRequest(f"messages.{i}.content.{j}",
                                         "only text parts ({'type': 'text', 'text': ...}) are implemented")
                texts.append(part["text"])
            content = "".join(texts)
        messages.append((message.role, content, extra))
    return validation.checked_chat_messages(messages)


# Logprobs in the shape of each API.

def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of its byte table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = _bytes_to_unicode()


class TokenText:
    """A tokenizer's per-token strings and raw bytes, as logprobs report them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        self._backend = backend if byte_level else None
        self._added = set(backend.get_added_tokens_decoder()) if byte_level else set()

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: part of a multi-byte character is its bytes, not U+FFFD."""
        if self._backend is not None and token_id not in self._added:
            piece = self._backend.id_to_token(token_id)
            if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
                return [_BYTE_OF_CHAR[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(logprobs: tuple[TokenLogprob, ...], token_text: TokenText, text_offset: int) -> dict:
    """``/v1/completions`` logprobs: parallel lists; ``text_offset`` is where the first token
    starts in the completion text."""
    tokens, offsets = [], []
    for lp in logprobs:
        tokens.append(token_text.text(lp.token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text.text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: tuple[TokenLogprob, ...], token_text: TokenText) -> dict:
    """``/v1/chat/completions`` logprobs: one entry per token with its bytes and alternatives."""
    def entry(token_id, logprob):
        return {"token": token_text.text(token_id), "logprob": logprob, "bytes": token_text.bytes(token_id)}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}
