"""Between the gRPC messages of ``shiftjax.v1`` and the engine service's types.

Every check a client can fail raises :class:`InvalidRequest` naming the request field, so
the server answers ``INVALID_ARGUMENT`` with a message that says what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

from google.protobuf import descriptor_pb2, unknown_fields

from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.structured_outputs import StructuredOutputs
from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb
from shiftjax.serving.server import validation
from shiftjax.serving.server.protocol import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Delta, GenerationRequest,
                                              ServiceStats)
from shiftjax.serving.server.request_ids import checked_request_id
from shiftjax.serving.server.tokenize_pool import encode
from shiftjax.serving.server.validation import checked_cache_salt

FINISH_REASON = {FINISH_STOP: pb.FINISH_REASON_STOP, FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
                 FINISH_ABORT: pb.FINISH_REASON_ABORT}
# Sampling fields declared `optional`: absent means the SamplingParams default.
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
_PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")
# StructuredOutputs' oneof field -> the engine's kind, and the engine's field names back
_CONSTRAINT_KINDS = {"json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                     "grammar": "grammar"}
_PROTO_FIELD_OF = {f"structured_outputs.{kind}": f"structured_outputs.{name}"
                   for name, kind in _CONSTRAINT_KINDS.items()}


def sampling_params_from(request: pb.GenerateRequest) -> SamplingParams:
    if request.HasField("n") and request.n != 1:
        raise InvalidRequest("n", f"only n=1 is supported, got {request.n}; send the request n times instead")
    given = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING_FIELDS if request.HasField(name)}
    return validation.sampling_params(**given, stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids),
                                      ignore_eos=request.ignore_eos, logprobs=request.logprobs,
                                      top_logprobs=request.top_logprobs,
                                      structured_outputs=structured_outputs_from(request),
                                      disable_speculation=request.disable_speculation)


def structured_outputs_from(request: pb.GenerateRequest) -> StructuredOutputs | None:
    """The engine's constraint for ``request.structured_outputs`` (None when absent). A oneof
    member has presence, so an empty string or ``json_object: false`` is a member set, and
    refused by name rather than read as no constraint."""
    if not request.HasField("structured_outputs"):
        return None
    message = request.structured_outputs
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest("structured_outputs", f"sets no constraint; set exactly one of "
                                                   f"{', '.join(_CONSTRAINT_KINDS)}, or leave structured_outputs out")
    if kind == "json_object" and not message.json_object:
        raise InvalidRequest("structured_outputs.json_object", "must be true when set; for free text leave "
                                                               "structured_outputs out")
    value = getattr(message, kind)
    if kind == "choice":  # said here in the proto's words: the engine's would speak of a tuple
        value = tuple(value.choices)
        if not value:
            raise InvalidRequest("structured_outputs.choice", "has no choices; give at least one string")
        if "" in value:
            raise InvalidRequest("structured_outputs.choice", f"choice {value.index('')} is empty; every "
                                                              "choice must be a non-empty string")
    with proto_field_names():
        return StructuredOutputs(**{_CONSTRAINT_KINDS[kind]: value})


@contextlib.contextmanager
def proto_field_names():
    """Renames an :class:`InvalidRequest` raised inside it from the engine's spelling of a
    constraint's field (``structured_outputs.json``) to inference.proto's
    (``structured_outputs.json_schema``)."""
    try:
        yield
    except InvalidRequest as error:
        if error.field not in _PROTO_FIELD_OF:
            raise
        raise InvalidRequest(_PROTO_FIELD_OF[error.field], str(error).removeprefix(f"{error.field}: ")) from None


def check_structured_outputs(service, params: SamplingParams):
    """Has ``service`` compile ``params``' constraint, if any (CPU work, for a pool thread,
    before ``submit``), and returns it compiled, for ``GenerationRequest.grammar`` (None
    without one): one that does not compile is :class:`InvalidRequest` naming the proto's
    field."""
    if params.structured_outputs is None:
        return None
    with proto_field_names():
        return service.check_structured_outputs(params)


def messages_from(messages) -> list[dict[str, str]]:
    """The chat messages as a template takes them, by the rule HTTP's are read by."""
    return validation.checked_chat_messages((message.role, message.content) for message in messages)


def render_chat(tokenizer, messages) -> str:
    """The chat template's prompt text; a template that refuses the conversation (most
    raise on roles out of order) or a model without one is the request's fault."""
    try:
        return tokenizer.apply_chat_template(messages_from(messages), add_generation_prompt=True)
    except InvalidRequest:
        raise
    except Exception as error:  # jinja2's TemplateError, CheckpointError: no template
        raise InvalidRequest("messages", f"the chat template refused them: {str(error)[:300]}") from None


def prompt_ids_from(request: pb.GenerateRequest, tokenizer) -> tuple[int, ...]:
    """Token ids of the one prompt given: text as offline ``generate`` encodes it (with the
    tokenizer's special tokens), chat messages rendered then encoded without them."""
    given = [name for name in _PROMPT_FIELDS if len(getattr(request, name))]
    if len(given) > 1:
        raise InvalidRequest(given[1], f"give only one of prompt, prompt_ids and messages, got {' and '.join(given)}")
    if not given:
        raise InvalidRequest("prompt", "the prompt is empty; give prompt, prompt_ids or messages")
    if given[0] == "prompt_ids":
        return tuple(request.prompt_ids)  # the service checks them against the model's vocabulary
    if given[0] == "prompt":
        ids = encode(tokenizer, request.prompt, add_special_tokens=True)
    else:
        ids = encode(tokenizer, render_chat(tokenizer, request.messages), add_special_tokens=False)
    if not ids:
        raise InvalidRequest(given[0], "encodes to no tokens")
    return tuple(ids)


def refuse_mistyped_fields(message, prefix: str = "") -> None:
    """A declared field sent with another wire type (say a number where ``cache_salt``, a
    string, belongs) is parsed as an unknown field and would be dropped unseen: refused
    instead, naming it (``prefix`` and its path, in the messages it nests that are set)."""
    declared = message.DESCRIPTOR.fields_by_number
    for unknown in unknown_fields.UnknownFieldSet(message):
        field = declared.get(unknown.field_number)
        if field is not None:
            kind = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower()
            raise InvalidRequest(prefix + field.name, f"must be a {kind} (inference.proto); it was sent as "
                                                      f"protobuf wire type {unknown.wire_type}")
    for field, value in message.ListFields():
        if field.message_type is not None and not field.is_repeated:
            refuse_mistyped_fields(value, f"{prefix}{field.name}.")


def deadline_from(time_remaining: float | None) -> float | None:
    """The call's gRPC deadline, ``time_remaining`` seconds from now (None: none), as a
    ``time.monotonic()`` instant: the request's own deadline, so the engine ends it even
    between streamed tokens. Read it first: the later it is read, the later this deadline
    falls behind gRPC's."""
    return None if time_remaining is None else time.monotonic() + time_remaining


def client_request_id(request: pb.GenerateRequest) -> str | None:
    """The client's ``request_id`` (None when empty), checked by ``request_ids.checked_request_id``."""
    return checked_request_id(request.request_id)


def generation_request_from(request: pb.GenerateRequest, tokenizer, deadline: float | None) -> GenerationRequest:
    """The service's request for ``request`` (tokenizing: CPU work, for a pool thread), with
    ``deadline`` from :func:`deadline_from` and no request id: the client's ``request_id`` is
    a label of its own call (:func:`client_request_id`), never the service's key, so no
    client can take another's. An empty ``cache_salt`` is the field left out (proto3 strings
    have no presence)."""
    refuse_mistyped_fields(request)
    params = sampling_params_from(request)
    return GenerationRequest(prompt_ids=prompt_ids_from(request, tokenizer), params=params, deadline=deadline,
                             cache_salt=checked_cache_salt(request.cache_salt or None))


def response_from(delta: Delta, request_id: str | None = None) -> pb.GenerateResponse:
    """The response for ``delta``, carrying ``request_id`` (the client's label) when given,
    else the service's id."""
    response = pb.GenerateResponse(request_id=request_id or delta.request_id, token_ids=delta.token_ids,
                                   text=delta.text)
    for entry in delta.logprobs:
        response.logprobs.add(token_id=entry.token_id, logprob=entry.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top])
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASON[delta.finish_reason]
    if isinstance(delta.stop_reason, str):
        response.stop_string = delta.stop_reason
    elif delta.stop_reason is not None:
        response.stop_token_id = delta.stop_reason
    if delta.usage is not None:
        u = delta.usage
        response.usage.CopyFrom(pb.Usage(
            prompt_tokens=u.prompt_tokens, output_tokens=u.output_tokens, queue_seconds=u.queue_seconds,
            ttft_seconds=u.ttft_seconds, e2e_seconds=u.e2e_seconds, modes=u.modes, preemptions=u.preemptions,
            cached_prompt_tokens=u.cached_prompt_tokens))
    return response


def server_info_from(info: dict, stats: ServiceStats) -> pb.ServerInfoResponse:
    """``info`` is ``service.info()`` (its layout: serving/server/service_info.py); fields it lacks
    stay at their zero values, and the whole of it travels as JSON in ``info_json``."""
    buckets, pool, policy = info.get("buckets", {}), info.get("page_pool", {}), info.get("policy", {})
    engine = stats.engine
    startup, limits = info.get("startup", {}), info.get("limits", {})
    return pb.ServerInfoResponse(
        model=str(info.get("model", "")), modes=[str(m) for m in info.get("modes", ())],
        mesh={str(k): v for k, v in info.get("mesh", {}).items() if isinstance(v, int)},  # axis sizes
        token_buckets=buckets.get("tokens", ()), seq_buckets=buckets.get("seqs", ()),
        page_size=pool.get("page_size", 0), num_pages=engine.num_pages, free_pages=engine.free_pages,
        max_model_len=limits.get("max_model_len", 0), policy=str(policy.get("name", "")),
        timings=[pb.StepTiming(mode=row["mode"], tokens=row["tokens"], seqs=row["seqs"], seconds=row["seconds"])
                 for row in policy.get("timing", ())],
        executables=startup.get("executables", 0), compile_cache_hits=startup.get("cache_hits", 0),
        compile_seconds=startup.get("compile_seconds", 0.0), running=engine.running, waiting=engine.waiting,
        steps=engine.steps, switches=engine.switches, preemptions=engine.preemptions,
        steps_by_mode=engine.steps_by_mode, tokens_by_mode=engine.tokens_by_mode, ready=stats.ready,
        draining=stats.draining, info_json=json.dumps(jsonable(info), sort_keys=True),
        speculative=speculative_info_from(info["speculative"], stats) if "speculative" in info else None,
        quantization=str(info.get("quantization", {}).get("weights", "")),
        kv_cache_dtype=str(info.get("quantization", {}).get("kv_cache_dtype", "")))


def speculative_info_from(section: dict, stats: ServiceStats) -> pb.SpeculativeInfo:
    """ServerInfo's speculative decoding: how, from ``info``'s section (service_info.py's
    ``speculative_info``), and what it did, from ``stats`` (read now, as the other counters)."""
    counters = stats.engine.speculative
    return pb.SpeculativeInfo(
        enabled=bool(section.get("enabled")), method=str(section.get("method") or ""),
        num_speculative_tokens=int(section.get("num_speculative_tokens") or 0),
        disable_by_batch_size=section.get("disable_by_batch_size"),  # None: no limit, left unset
        acceptance_rate=counters.acceptance_rate, mean_accepted_length=counters.mean_accepted_length,
        num_drafts=counters.num_drafts, num_draft_tokens=counters.num_draft_tokens,
        num_accepted_tokens=counters.num_accepted_tokens, accepted_per_position=counters.accepted_per_position,
        draft_seconds=counters.draft_seconds)


def jsonable(value):
    """``value`` with tuple keys joined by '/', dataclasses as dicts, unknown objects as str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
