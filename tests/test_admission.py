"""The admission rules, written once (serving/engine/admission.py): the service's validation
and the scheduler refuse a request with the same InvalidRequest, naming the same field; the
scheduler applies the engine's share of them (the prompt and its room), not the sampling
limits a front end checks, and a rule whose limit is unknown (None) is not checked."""

import dataclasses

import pytest

from shiftjax.serving.engine import admission
from shiftjax.serving.engine.errors import InvalidRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from shiftjax.serving.server.protocol import GenerationRequest, prompt_ids_or_error
from shiftjax.serving.server.validation import validate_request

LIMITS = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, page_size=4, num_pages=9,
                         max_queue=2, vocab_size=96, max_top_logprobs=5)
OK = SamplingParams(max_tokens=4)

# (prompt, params, the field named, words of the message); the first four are the scheduler's too
REFUSED = [
    ((), OK, "prompt_ids", "the prompt is empty"),
    ((1, 96), OK, "prompt_ids", "token id 96 at position 1 is outside the vocabulary [0, 96)"),
    ((1,) * 60, SamplingParams(max_tokens=10), "max_tokens", "exceeds max_model_len (64)"),
    ((1,) * 30, SamplingParams(max_tokens=10), "max_tokens", "more KV-cache pages than the cache has (8 of 4"),
    ((1,), SamplingParams(max_tokens=4, logprobs=True, top_logprobs=6), "top_logprobs", "at most 5 alternatives"),
    ((1,), SamplingParams(max_tokens=4, stop_token_ids=(500, 3)), "stop_token_ids", "[500] are outside"),
]


@pytest.mark.parametrize("prompt,params,field,words", REFUSED)
def test_validation_names_the_field(prompt, params, field, words):
    with pytest.raises(InvalidRequest) as refused:
        validate_request(LIMITS, GenerationRequest(prompt, params))
    assert refused.value.field == field and words in str(refused.value)


@pytest.mark.parametrize("prompt,params,field,words", REFUSED[:4])
def test_the_scheduler_refuses_as_validation_does(prompt, params, field, words):
    scheduler = Scheduler(LIMITS)
    with pytest.raises(InvalidRequest) as by_scheduler:
        scheduler.add(list(prompt), params)
    with pytest.raises(InvalidRequest) as by_validation:
        validate_request(LIMITS, GenerationRequest(prompt, params))
    assert str(by_scheduler.value) == str(by_validation.value) and by_scheduler.value.field == field
    assert isinstance(by_scheduler.value, ValueError)  # what Engine.add_request's callers catch
    assert not scheduler.has_work


@pytest.mark.parametrize("prompt,params,field,words", REFUSED[4:])
def test_the_scheduler_leaves_the_sampling_limits_to_the_front_end(prompt, params, field, words):
    assert Scheduler(LIMITS).add(list(prompt), params).params is params


def test_unknown_limits_are_not_checked():
    unknown = dataclasses.replace(LIMITS, vocab_size=None, max_top_logprobs=None)
    for prompt, params, _, _ in REFUSED[1:2] + REFUSED[4:]:
        assert admission.check_request(prompt, params, unknown) == prompt
    with pytest.raises(InvalidRequest, match="empty"):
        admission.check_request((), OK, unknown)


def test_the_queue_bound_comes_after_the_rules():
    scheduler = Scheduler(LIMITS)
    scheduler.add([1], OK), scheduler.add([2], OK)
    with pytest.raises(InvalidRequest):  # a bad request is named as such even when the queue is full
        scheduler.add([], OK)
    with pytest.raises(QueueFull):
        scheduler.add([3], OK)


def test_the_front_ends_check_prompts_by_the_same_rule():
    assert prompt_ids_or_error is admission.checked_prompt_ids
    assert prompt_ids_or_error([3, 4], 96) == (3, 4)
    with pytest.raises(InvalidRequest) as refused:
        prompt_ids_or_error([1, -1], 96, "prompt.2")
    assert refused.value.field == "prompt.2" and "position 1" in str(refused.value)
