"""What the engine service and both front ends refuse, each rule written once and naming the
field to change: the request as the service takes it (:func:`validate_request`), the sampling
parameters and chat messages as either front end reads them, the cache salt, and the
bearer token. gRPC and HTTP call the same functions here, so they accept the same values."""

from __future__ import annotations

import hmac

from shiftjax.serving.engine.admission import check_request, check_room
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import SchedulerConfig
from shiftjax.serving.server.protocol import GenerationRequest

# The largest request either front end reads: an HTTP body (413 past it) and a gRPC message
# (RESOURCE_EXHAUSTED), ``shiftjax serve --max-request-bytes``. gRPC's own default; a chat
# body of a long context fits many times over.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

# The roles a chat template is given. "developer" is the newer OpenAI name of "system" (chat
# templates know "system"); a "tool" message answers a call of the assistant message before it.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def sampling_params(**fields) -> SamplingParams:
    """:class:`SamplingParams` from the fields a front end read, with vLLM's spelling of "no
    top-k filter", ``top_k=-1``, read as 0 on both front ends; any invalid value raises
    :class:`InvalidRequest` naming the field."""
    if fields.get("top_k") == -1:
        fields["top_k"] = 0
    return SamplingParams(**fields)


def checked_chat_messages(messages, field: str = "messages") -> list[dict]:
    """``messages`` as a chat template takes them, or :class:`InvalidRequest` naming
    ``field.i.role`` (a role outside :data:`CHAT_ROLES`), ``field.i.tool_call_id`` or
    ``field`` (no message). Each message is (role, text content) or (role, text content,
    extra), ``extra`` the checked keys a template reads besides: ``tool_calls`` (an
    assistant's calls, each with an ``id``) or ``tool_call_id``. A ``tool`` message must
    answer, by ``tool_call_id``, a call of the assistant message before it (other tool
    messages between), as OpenAI's API requires; over gRPC, whose messages carry no calls,
    none can. The answered call's function is the message's ``name`` (some templates read it)."""
    rendered, open_calls = [], {}
    for i, (role, content, *extra) in enumerate(messages):
        extra = dict(extra[0]) if extra else {}
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{field}.{i}.role", f"the role must be one of {', '.join(CHAT_ROLES)}, "
                                                      f"got {shown(role)}")
        message = {"role": "system" if role == "developer" else role, "content": content or ""}
        if role == "tool":
            if not open_calls:
                raise InvalidRequest(f"{field}.{i}.role", "a 'tool' message answers a tool call: it must follow "
                                                          "an assistant message with tool_calls (or another "
                                                          "tool message)")
            call_id = extra.pop("tool_call_id", None)
            if call_id not in open_calls:
                raise InvalidRequest(f"{field}.{i}.tool_call_id", f"must be the id of a call it answers, one of "
                                                                  f"{shown(list(open_calls), 80)}; got {shown(call_id)}")
            message |= {"tool_call_id": call_id, "name": open_calls[call_id]}
        else:
            open_calls = {}
        if role == "assistant" and extra.get("tool_calls"):
            open_calls = {call["id"]: call["function"]["name"] for call in extra["tool_calls"]}
        rendered.append(message | extra)
    if not rendered:
        raise InvalidRequest(field, "is empty; give at least one message")
    return rendered


def bearer_token_matches(header, api_key: str) -> bool:
    """Whether an ``Authorization`` header (str or bytes, None when absent) carries ``api_key``
    as RFC 6750 spells it: the scheme ``Bearer`` in any case, one or more spaces, the token;
    whitespace around the whole value is not part of it (RFC 9110's optional whitespace). The
    token itself is compared exactly, in constant time."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    if not isinstance(header, str):
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.lstrip(" ").encode(), api_key.encode())


def checked_cache_salt(salt, field: str = "cache_salt") -> str | None:
    """``salt`` if it may be a request's cache salt, else :class:`InvalidRequest` naming
    ``field``: None (the shared cache) or a non-empty string. An empty string is refused, as
    vLLM refuses it, rather than read as "no salt": a tenant whose salt came out empty would
    otherwise share the cache it meant to leave. (Over gRPC, where a string field cannot be
    absent, an empty ``cache_salt`` is the field left out.)"""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise InvalidRequest(field, f"must be a string, got {type(salt).__name__}")
    if not salt:
        raise InvalidRequest(field, "must be a non-empty string when given; leave it out to share the cache")
    return salt


def validate_request(limits: SchedulerConfig, request) -> None:
    """Raises :class:`InvalidRequest` for a request that is not a :class:`GenerationRequest`
    with :class:`SamplingParams`, or that breaks a rule of admission.check_request against
    the engine's running ``limits`` (``engine.limits``): an empty prompt or a token id
    outside the vocabulary (``prompt_ids``), a prompt plus ``max_tokens`` past
    ``max_model_len`` or past the page pool (``max_tokens``), more alternatives than the
    steps return (``top_logprobs``), stop token ids outside the vocabulary
    (``stop_token_ids``); or whose ``cache_salt`` is not None or a non-empty string.

    A prompt longer than ``max_model_len`` is refused by its length before its ids are
    read one by one (the same refusal check_request makes, without its cost: this runs on
    the caller's event loop)."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequest("request", f"expected a GenerationRequest, got {type(request).__name__}")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params", f"expected SamplingParams, got {type(params).__name__}")
    if isinstance(request.prompt_ids, (tuple, list)) and len(request.prompt_ids) > limits.max_model_len:
        check_room(len(request.prompt_ids), params, limits)
    check_request(request.prompt_ids, params, limits)
    checked_cache_salt(request.cache_salt)


def field_path(parts) -> str:
    """A field's name from its path (``messages.0.role``) as an error may name it: a part a
    client chose (an unknown key) that is not short printable ASCII is shown as its cut
    ``repr``, so that the name carries no megabytes, escapes or lone surrogates."""
    return ".".join(_field_part(str(part)) for part in parts)


def _field_part(text: str) -> str:
    return text if 0 < len(text) <= 64 and all("!" <= c <= "~" for c in text) else shown(text)


def shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message must not echo a client's
    megabytes (or its terminal escapes: repr escapes them)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else \
        f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else f"{len(text)} characters"
    return f"{text[:limit]}... ({size})"
