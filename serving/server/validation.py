"""What the engine service refuses before a request is queued, naming the field to change."""

from __future__ import annotations

from shiftjax.serving.engine.admission import check_request
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import SchedulerConfig
from shiftjax.serving.server.protocol import GenerationRequest


def validate_request(limits: SchedulerConfig, request) -> None:
    """Raises :class:`InvalidRequest` for a request that is not a :class:`GenerationRequest`
    with :class:`SamplingParams`, or that breaks a rule of admission.check_request against
    the engine's running ``limits`` (``engine.limits``): an empty prompt or a token id
    outside the vocabulary (``prompt_ids``), a prompt plus ``max_tokens`` past
    ``max_model_len`` or past the page pool (``max_tokens``), more alternatives than the
    steps return (``top_logprobs``), stop token ids outside the vocabulary
    (``stop_token_ids``)."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequest("request", f"expected a GenerationRequest, got {type(request).__name__}")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params", f"expected SamplingParams, got {type(params).__name__}")
    check_request(request.prompt_ids, params, limits)
