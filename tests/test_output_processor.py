"""The one output processor of LLM.generate (offline: ``stream=False``) and the engine
service (streaming): fed the same deliveries, both give the same text, finish reason and
stop reason, which are the ones a full decode and the request's end imply."""

import random

import pytest

from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_tokenizer
from shiftjax.serving.engine.output_processor import OutputProcessor
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import Request

EOS = 0  # <|endoftext|> of the default model's tokenizer
TEXTS = ["Hello, world! The quick brown fox jumps over the lazy dog.",
         "Emoji: 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, then text again.",
         "東京は日本の首都です。北京是中国的首都。"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def run(tokenizer, ids, params, chunks, stream):
    """Delivers ``ids`` in ``chunks`` as the scheduler commits them (EOS or a stop token id
    ends with "stop", max_tokens with "length"); a stop string aborts, as both callers do.
    Returns the text, the finish and stop reasons, and the tokens delivered."""
    request = Request(0, [1], params, () if params.ignore_eos else (EOS,))
    output, pieces, i = OutputProcessor(tokenizer, params, stream=stream), [], 0
    for size in chunks:
        for token in ids[i:i + size]:
            request.output_ids.append(token)
            if token in request.eos_token_ids or token in params.stop_token_ids:
                request.finish_reason = "stop"
            elif len(request.output_ids) >= params.max_tokens:
                request.finish_reason = "length"
            if request.finished:
                break
        i += size
        taken = output.sent
        delta = output.update(request)
        # the step's tokens, up to the one that completes a stop string (a verified draft's several)
        assert delta.token_ids == tuple(request.output_ids[taken:output.sent])
        pieces.append(delta.text)
        if delta.finish_reason is not None:
            request.finish_reason = request.finish_reason or "abort"
            assert output.update(request).text == ""  # nothing after the end
            break
        assert not request.finished  # an end the engine made is always reported
    return "".join(pieces), output.finish_reason, output.stop_reason, request.output_ids[:output.sent]


def test_streamed_and_offline_outputs_agree(tokenizer):
    rng = random.Random(3)
    for _ in range(80):
        full = rng.choice(TEXTS)
        ids = tokenizer.encode(full, add_special_tokens=False)
        ends = rng.choice(["length", "eos", "stop_token"])
        if ends == "eos":
            ids.insert(rng.randrange(len(ids)), EOS)
        stop_token_ids = (ids[rng.randrange(len(ids))],) if ends == "stop_token" else ()
        stop = ()
        if rng.random() < 0.6:
            start = rng.randrange(len(full))
            stop = (full[start:start + rng.randrange(1, 5)],)
        params = SamplingParams(max_tokens=rng.randrange(1, len(ids) + 1), stop=stop, stop_token_ids=stop_token_ids,
                                ignore_eos=ends != "eos")
        chunks = [rng.randrange(1, 4) for _ in ids]
        streamed = run(tokenizer, ids, params, chunks, stream=True)
        offline = run(tokenizer, ids, params, chunks, stream=False)
        assert streamed == offline, (full, params)
        text, reason, stop_reason, delivered = streamed
        decoded = tokenizer.decode(delivered)
        matched = [s for s in stop if s in decoded]
        if matched:  # a stop string ends the text before it, whatever else ended the request
            assert (text, reason, stop_reason) == (decoded[:decoded.find(matched[0])], "stop", matched[0])
            # and the output at the token that completes it, however many the step delivered
            assert not any(s in tokenizer.decode(delivered[:-1]) for s in stop)
        else:
            assert text == decoded
            last = delivered[-1]
            assert reason == ("stop" if last == EOS and ends == "eos" or last in stop_token_ids else "length")
            assert stop_reason == (last if last in stop_token_ids else None)  # None for EOS, as vLLM


def test_a_stop_string_wins_over_the_engine_end_in_the_same_step(tokenizer):
    ids = tokenizer.encode("Hello, world!", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=("world!",), ignore_eos=True)
    for stream in (True, False):
        assert run(tokenizer, ids, params, [1] * len(ids), stream)[:3] == ("Hello, ", "stop", "world!")


def test_offline_without_stop_strings_decodes_once_at_the_end(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True)
    request = Request(0, [1], params, ())
    output = OutputProcessor(tokenizer, params, stream=False)
    for token in ids[:-1]:
        request.output_ids.append(token)
        assert output.update(request).text == ""
    request.output_ids.append(ids[-1])
    request.finish_reason = "length"
    assert output.update(request).text == TEXTS[1]


def test_a_stop_string_in_the_text_held_until_the_end_still_stops(tokenizer):
    """' �' (a space and the first byte of an emoji) is held back while its character is
    incomplete; a request that ends on it (max_tokens) flushes it at its end, and the stop
    string ' ' matches there: the reason is then "stop", as for a match in any other step."""
    ids = tokenizer.encode("Emoji: 😀", add_special_tokens=False)[:4]
    assert tokenizer.decode(ids[3:]) == " \ufffd"
    params = SamplingParams(max_tokens=4, stop=(" ",), ignore_eos=True)
    for stream in (True, False):
        assert run(tokenizer, ids, params, [1] * 4, stream)[:3] == ("Emoji:", "stop", " ")
