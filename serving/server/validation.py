"""What the engine service refuses before a request is queued, naming the field to change."""

from __future__ import annotations

from shiftjax.serving.engine.core import Engine
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.server.protocol import GenerationRequest, prompt_ids_or_error
from shiftjax.serving.engine.sampling_params import SamplingParams


def validate_request(engine: Engine, request) -> None:
    """Raises :class:`InvalidRequest` for a request this engine cannot serve as given: an
    empty prompt or a token id outside the vocabulary (``prompt_ids``), a prompt plus
    ``max_tokens`` past ``max_model_len`` or past the page pool (``max_tokens``), more
    alternatives than the steps return (``top_logprobs``), stop token ids outside the
    vocabulary (``stop_token_ids``)."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequest("request", f"expected a GenerationRequest, got {type(request).__name__}")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise InvalidRequest("params", f"expected SamplingParams, got {type(params).__name__}")
    vocab = engine.weights.config.vocab_size
    prompt = prompt_ids_or_error(request.prompt_ids, vocab)
    limit = engine.config.max_model_len
    if len(prompt) + params.max_tokens > limit:
        raise InvalidRequest("max_tokens", f"the prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len ({limit}); shorten the "
                             f"prompt or lower max_tokens")
    page_size, usable = engine.config.page_size, engine.num_pages - 1
    if -(-(len(prompt) + params.max_tokens) // page_size) > usable:
        raise InvalidRequest("max_tokens", f"the prompt plus max_tokens needs more KV-cache pages than "
                             f"the cache has ({usable} of {page_size} tokens); lower max_tokens")
    if params.top_logprobs > engine.config.max_top_logprobs:
        raise InvalidRequest("top_logprobs", f"this server returns at most "
                             f"{engine.config.max_top_logprobs} alternatives, got {params.top_logprobs}")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequest("stop_token_ids", f"{bad[:5]} are outside the vocabulary [0, {vocab})")
