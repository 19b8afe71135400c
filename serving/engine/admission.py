"""The rules a request must meet to be admitted, each written once.

``Scheduler.add`` applies the engine's share (:func:`check_admission`: the prompt, and the
room it needs in ``max_model_len`` and the page pool); the service's validation applies all
of them (:func:`check_request`) on the caller's thread, before anything is queued; the
front ends check the prompts they tokenize by :func:`checked_prompt_ids`. Each refusal is
:class:`InvalidRequest` naming the field to change. The limits are the engine's running
ones (``engine.limits``, a :class:`SchedulerConfig`); a rule whose limit it leaves ``None``
(``vocab_size``, ``max_top_logprobs``) is not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shiftjax.cache import pages_for
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler imports this module
    from shiftjax.serving.engine.scheduler import SchedulerConfig


def checked_prompt_ids(ids: Sequence[int], vocab_size: int | None, field: str = "prompt_ids") -> tuple[int, ...]:
    """``ids`` as a tuple of ints, or :class:`InvalidRequest` naming ``field``: an empty prompt,
    or a token id outside ``[0, vocab_size)`` (unchecked when ``vocab_size`` is None)."""
    if len(ids) == 0:
        raise InvalidRequest(field, "the prompt is empty; give at least one token")
    if vocab_size is not None:
        for i, token in enumerate(ids):
            if not 0 <= int(token) < vocab_size:
                raise InvalidRequest(field, f"token id {token} at position {i} is outside the vocabulary "
                                            f"[0, {vocab_size})")
    return tuple(int(t) for t in ids)


def check_room(prompt_len: int, params: SamplingParams, limits: SchedulerConfig) -> None:
    """The prompt plus ``max_tokens`` must fit ``max_model_len`` and the page pool (page 0,
    the scratch page, is no request's)."""
    total = prompt_len + params.max_tokens
    if total > limits.max_model_len:
        raise InvalidRequest("max_tokens", f"the prompt ({prompt_len} tokens) plus max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len ({limits.max_model_len}); shorten "
                             f"the prompt or lower max_tokens")
    usable = limits.num_pages - 1
    if pages_for(total, limits.page_size) > usable:
        raise InvalidRequest("max_tokens", f"the prompt plus max_tokens needs more KV-cache pages than "
                             f"the cache has ({usable} of {limits.page_size} tokens); lower max_tokens")


def check_sampling(params: SamplingParams, limits: SchedulerConfig) -> None:
    """No more alternatives than a step returns; stop token ids inside the vocabulary."""
    most = limits.max_top_logprobs
    if most is not None and params.top_logprobs > most:
        raise InvalidRequest("top_logprobs", f"this server returns at most {most} alternatives, "
                             f"got {params.top_logprobs}")
    vocab = limits.vocab_size
    bad = [] if vocab is None else [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidRequest("stop_token_ids", f"{bad[:5]} are outside the vocabulary [0, {vocab})")


def check_admission(prompt_ids: Sequence[int], params: SamplingParams, limits: SchedulerConfig) -> None:
    """What ``Scheduler.add`` refuses: an empty prompt, token ids outside the vocabulary, a
    prompt plus ``max_tokens`` past ``max_model_len`` or past the page pool."""
    checked_prompt_ids(prompt_ids, limits.vocab_size)
    check_room(len(prompt_ids), params, limits)


def check_request(prompt_ids: Sequence[int], params: SamplingParams, limits: SchedulerConfig) -> tuple[int, ...]:
    """Every rule: :func:`check_admission`'s, then :func:`check_sampling`'s; returns the
    prompt as a tuple of ints."""
    prompt = checked_prompt_ids(prompt_ids, limits.vocab_size)
    check_room(len(prompt), params, limits)
    check_sampling(params, limits)
    return prompt
