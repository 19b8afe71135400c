"""What the engine service refuses before a request is queued, naming the field to change."""

from __future__ import annotations

from shiftjax.serving.engine.admission import check_request
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import SchedulerConfig
from shiftjax.serving.server.protocol import GenerationRequest


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
    (``stop_token_ids``); or whose ``cache_salt`` is not None or a non-empty string."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequest("request", f"expected a GenerationRequest, got {type(request).__name__}")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params", f"expected SamplingParams, got {type(params).__name__}")
    check_request(request.prompt_ids, params, limits)
    checked_cache_salt(request.cache_salt)
