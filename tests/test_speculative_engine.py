"""Speculative decoding in the engine, on the CPU meshes. Verification is exact whatever the
drafter: with scripted drafters that are always right, always wrong or right for a while,
greedy decoding of a crowded batch (chunked prefill, preemption) generates what
transformers' greedy decoding does, in every mode; seeded sampled decoding generates what
it generates without speculation; and sampled outputs follow the target distribution (a
chi-square test, which a verifier that skips the correction fails)."""

import jax
import numpy as np
import pytest
import torch
from structured_tiny import CONFIG, EOS
from test_parallel import transformers_model

from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine import scheduler as scheduler_module
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.speculative import DraftBackoff, SpeculativeConfig
from shiftjax.weights import shard_params

# 4-token pages, 16 tokens a step (the longer prompts are chunked), 14 usable pages for six
# sequences of up to 44 tokens: page pressure preempts. 8 rows a step: drafts take the rows
# the running and waiting requests leave.
OPTIONS = dict(max_model_len=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(8, 16),
               seq_buckets=(8,), attention="reference", num_pages=15, enable_prefix_caching=False)
K = 3
SPECULATIVE = SpeculativeConfig("ngram", num_speculative_tokens=K, disable_by_batch_size=None)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 9, 10],
           [30, 31], [40, 41, 42, 43, 44, 40, 41, 42, 43], [50], [60, 61, 62, 63, 64, 65, 66, 67, 68, 60, 61]]
MAX_TOKENS = [20, 24, 16, 28, 12, 20]


class ScriptedDrafter:
    """Drafts each request's known continuation (by prompt): ``right`` as it is, ``wrong``
    with every token changed, ``mixed`` right for two tokens then wrong."""

    def __init__(self, continuations: dict[tuple, list[int]], kind: str):
        self.continuations, self.kind = continuations, kind
        self.proposed = 0

    def propose(self, request, max_tokens):
        known = self.continuations[tuple(request.prompt_ids)][len(request.output_ids):][:max_tokens]
        if self.kind == "wrong":
            known = [(t + 1) % CONFIG.vocab_size for t in known]
        elif self.kind == "mixed":
            known = known[:2] + [(t + 1) % CONFIG.vocab_size for t in known[2:]]
        self.proposed += len(known)
        return known

    def finish(self, request):
        pass

    def learn_pending(self, done):
        pass


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=5, scale=0.3)


@pytest.fixture(scope="module")
def expected(params):
    """transformers' greedy continuation of each prompt, ended as the scheduler ends one."""
    model, outputs = transformers_model(params, CONFIG), []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        tokens = list(prompt)
        while len(tokens) - len(prompt) < max_tokens and tokens[-1:] != [EOS] or len(tokens) == len(prompt):
            with torch.no_grad():
                tokens.append(int(torch.argmax(model(torch.tensor([tokens])).logits[0, -1])))
        outputs.append(tokens[len(prompt):])
    return outputs


def engine_on(params, sp, tp, speculative=SPECULATIVE, **options) -> Engine:
    weights = shard_params(params, CONFIG, make_mesh(sp, tp, jax.devices()[:sp * tp]))
    return Engine(weights, EngineConfig(**OPTIONS | dict(speculative=speculative) | options), eos_token_ids=(EOS,))


def generate(engine: Engine, sampling=lambda i: SamplingParams(max_tokens=MAX_TOKENS[i])):
    requests = [engine.add_request(p, sampling(i)) for i, p in enumerate(PROMPTS)]
    engine.run_until_done(requests)
    assert not engine.has_work
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1
    return requests


@pytest.mark.parametrize("kind", ["right", "wrong", "mixed"])
def test_verification_keeps_greedy_output_whatever_the_draft(params, expected, kind):
    engine = engine_on(params, 2, 2, mode="alternate")
    engine.scheduler.drafter = drafter = ScriptedDrafter({tuple(p): e for p, e in zip(PROMPTS, expected)}, kind)
    requests = generate(engine)
    assert [r.output_ids for r in requests] == expected
    assert engine.scheduler.num_preemptions > 0  # the pool is tight enough to preempt
    spec = engine.snapshot().speculative
    # (a draft that found no pages, or whose request was preempted before the commit, is not counted)
    assert spec.num_drafts > 0 and 0 < spec.num_draft_tokens <= drafter.proposed
    if kind == "right":
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    elif kind == "wrong":
        assert spec.num_accepted_tokens == 0
    else:
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


def sampled(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=1.1, top_p=0.9, seed=100 + i)


@pytest.mark.parametrize("kind", ["right", "mixed"])
def test_seeded_sampling_generates_what_it_does_without_speculation(params, kind):
    """Each row samples with the key a decode at its position uses, so a seeded request's
    tokens do not depend on what was drafted."""
    plain = [r.output_ids for r in generate(engine_on(params, 2, 2, mode="alternate", speculative=None), sampled)]
    engine = engine_on(params, 2, 2, mode="alternate")
    engine.scheduler.drafter = ScriptedDrafter({tuple(p): o for p, o in zip(PROMPTS, plain)}, kind)
    assert [r.output_ids for r in generate(engine, sampled)] == plain
    assert engine.snapshot().speculative.num_accepted_tokens > 0


# --- the distribution: the first three sampled tokens of one prompt, temperature 1, top 6;
# a draft for the second (the first is sampled by the prefill, which has no draft) ---

TOP_K, SAMPLES = 6, 1200
CHI_PROMPT = [12, 40, 7, 33, 20]


@pytest.fixture(scope="module")
def target(params):
    """transformers' joint distribution of the first three tokens (each within the top k),
    and per first token, its second token's distribution and a token outside its top k."""
    model = transformers_model(params, CONFIG)

    def top(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double().numpy()
        ids = np.argsort(-logits)[:TOP_K]
        p = np.exp(logits[ids] - logits[ids].max())
        return dict(zip(ids.tolist(), p / p.sum())), int(np.argmin(logits))

    first, _ = top(CHI_PROMPT)
    second = {a: top(CHI_PROMPT + [a]) for a in first}
    joint = {(a, b, c): pa * pb * pc for a, pa in first.items() for b, pb in second[a][0].items()
             for c, pc in top(CHI_PROMPT + [a, b])[0].items()}
    return joint, first, second


def sample_triples(engine: Engine) -> list[tuple[int, ...]]:
    triples = []
    for wave in range(0, SAMPLES, 8):  # 8 at a time: a queue would leave drafts no rows
        requests = [engine.add_request(CHI_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K,
                                                                  seed=seed, ignore_eos=True))
                    for seed in range(wave, wave + 8)]
        engine.run_until_done(requests)
        triples += [tuple(r.output_ids) for r in requests]
    return triples


def chi_square_p_value(samples, joint) -> float:
    """Pearson's test of the samples against ``joint``; cells expecting fewer than 5 pooled."""
    from scipy.stats import chi2

    counts = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    big = [cell for cell, p in joint.items() if p * len(samples) >= 5]
    observed = [counts.get(cell, 0) for cell in big]
    expected = [joint[cell] * len(samples) for cell in big]
    observed.append(len(samples) - sum(observed))  # every other triple, impossible ones included
    expected.append(len(samples) - sum(expected))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(chi2.sf(statistic, len(observed) - 1))


class SecondTokenDrafter:
    """Drafts one token for the second position, chosen by the first (or by the request;
    None: no draft)."""

    def __init__(self, by_first):
        self.by_first = by_first

    def propose(self, request, max_tokens):
        if len(request.output_ids) != 1 or not max_tokens or self.by_first is None:
            return []
        return [self.by_first(request)] if callable(self.by_first) else [self.by_first[request.output_ids[0]]]

    def finish(self, request):
        pass

    def learn_pending(self, done):
        pass


@pytest.fixture(scope="module")
def chi_engine(params):
    return engine_on(params, 1, 2, mode="tp", max_num_seqs=16, seq_buckets=(16,), token_buckets=(16,),
                     num_pages=40, speculative=SpeculativeConfig("ngram", num_speculative_tokens=1,
                                                                 disable_by_batch_size=None))


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["outside the top k", "most likely", "what it samples"])
def test_rejection_sampled_tokens_follow_the_target_distribution(chi_engine, target, draft):
    joint, first, second = target
    if draft == "outside the top k":  # always wrong
        by_first = {a: outside for a, (_, outside) in second.items()}
    elif draft == "most likely":
        by_first = {a: max(top, key=top.get) for a, (top, _) in second.items()}
    else:  # always right: the second token each seed gives without a draft
        chi_engine.scheduler.drafter = SecondTokenDrafter(None)
        seconds = [t[1] for t in sample_triples(chi_engine)]
        by_first = lambda request: seconds[request.params.seed]  # noqa: E731
        chi_engine._draft_backoff = DraftBackoff()  # that run found nothing to draft and backed off
    chi_engine.scheduler.drafter = SecondTokenDrafter(by_first)
    before = chi_engine.snapshot().speculative
    triples = sample_triples(chi_engine)
    spec = chi_engine.snapshot().speculative
    assert spec.num_drafts - before.num_drafts == SAMPLES
    accepted = (spec.num_accepted_tokens - before.num_accepted_tokens) / SAMPLES
    if draft == "outside the top k":
        assert accepted == 0  # a token the target never samples is never kept
    elif draft == "what it samples":
        assert accepted == 1
    else:  # kept as often as the target samples it
        p = sum(first[a] * second[a][0][d] for a, d in by_first.items())
        assert abs(accepted - p) < 4 * (p * (1 - p) / SAMPLES) ** 0.5
    assert chi_square_p_value(triples, joint) > 1e-3, chi_square_p_value(triples, joint)


@pytest.mark.slow
def test_a_verifier_that_skips_the_correction_fails_the_chi_square_test(chi_engine, target, monkeypatch):
    joint, _, second = target
    # keeps every draft: the least likely second token then always comes out
    monkeypatch.setattr(scheduler_module, "accepted_length", lambda draft, sampled: len(draft))
    chi_engine.scheduler.drafter = SecondTokenDrafter({a: min(top, key=top.get) for a, (top, _) in second.items()})
    assert chi_square_p_value(sample_triples(chi_engine), joint) < 1e-6


# --- the real drafters, every mode ---

@pytest.mark.slow
@pytest.mark.parametrize("method, sp, tp, mode, async_scheduling", [
    ("ngram", 2, 2, "tp", True), ("ngram", 2, 2, "sp", True), ("ngram", 2, 2, "alternate", True),
    ("ngram", 2, 2, "auto", True), ("ngram", 2, 2, "alternate", False), ("suffix", 2, 2, "alternate", True),
    ("suffix", 2, 2, "auto", True), ("suffix", 1, 2, "tp", False)])
def test_each_method_keeps_greedy_output_in_every_mode(params, expected, method, sp, tp, mode, async_scheduling):
    engine = engine_on(params, sp, tp, mode=mode, async_scheduling=async_scheduling,
                       speculative=SpeculativeConfig(method, num_speculative_tokens=K, disable_by_batch_size=None,
                                                     prompt_lookup_min=1, suffix_min_token_prob=0.0),
                       **({"shift_threshold": 16} if mode == "auto" else {}))  # the 8-token bucket in tp
    requests = generate(engine)
    assert [r.output_ids for r in requests] == expected
    assert engine.scheduler.num_preemptions > 0
    spec = engine.snapshot().speculative
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0  # the prompts repeat themselves
    if mode in ("alternate", "auto"):
        assert {"tp", "sp"} <= {m for r in requests for m in r.modes}  # drafts in both modes' steps


class RecordingDrafter:
    """Drafts the next two tokens of the known continuation; records who it drafted for and
    how many requests were running."""

    def __init__(self, scheduler, continuations):
        self.scheduler, self.continuations, self.calls = scheduler, continuations, []

    def propose(self, request, max_tokens):
        self.calls.append((tuple(request.prompt_ids), len(self.scheduler.running)))
        return self.continuations[tuple(request.prompt_ids)][len(request.output_ids):][:min(2, max_tokens)]

    def finish(self, request):
        pass

    def learn_pending(self, done):
        pass


def test_no_drafts_above_the_batch_limit_nor_for_requests_that_opt_out(params, expected):
    engine = engine_on(params, 1, 2, mode="tp", num_pages=40,
                       speculative=SpeculativeConfig("ngram", num_speculative_tokens=K, disable_by_batch_size=2))
    drafter = engine.scheduler.drafter = RecordingDrafter(engine.scheduler,
                                                          {tuple(p): e for p, e in zip(PROMPTS, expected)})
    opted_out = 1
    requests = generate(engine, lambda i: SamplingParams(max_tokens=MAX_TOKENS[i], disable_speculation=i == opted_out))
    assert [r.output_ids for r in requests] == expected
    assert drafter.calls and all(running <= 2 for _, running in drafter.calls)
    assert tuple(PROMPTS[opted_out]) not in {prompt for prompt, _ in drafter.calls}
    # the longest requests end alone, with drafts: fewer steps than tokens
    longest = max(range(len(PROMPTS)), key=lambda i: len(expected[i]))
    assert len(requests[longest].modes) < len(expected[longest])


def test_logprobs_and_the_end_are_those_without_speculation(params, expected):
    """A draft that runs past the end (EOS, then more) ends where the output ends; each
    kept token's logprob and alternatives are those decoding without speculation gives."""
    wanted = lambda i: SamplingParams(max_tokens=MAX_TOKENS[i], logprobs=True, top_logprobs=3)  # noqa: E731
    plain = generate(engine_on(params, 2, 2, mode="alternate", speculative=None), wanted)
    engine = engine_on(params, 2, 2, mode="alternate")
    engine.scheduler.drafter = ScriptedDrafter({tuple(p): e + [EOS, 7, 8, 9] for p, e in zip(PROMPTS, expected)},
                                               "right")
    drafted = generate(engine, wanted)
    assert [r.output_ids for r in drafted] == expected == [r.output_ids for r in plain]
    assert [r.finish_reason for r in drafted] == [r.finish_reason for r in plain]
    for a, b in zip(drafted, plain):
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=1e-4, atol=1e-5)
        assert [[t for t, _ in top] for top in a.output_top_logprobs] == [[t for t, _ in top] for top in b.output_top_logprobs]
    assert engine.snapshot().speculative.num_accepted_tokens > 0


def test_suffix_decoding_drafts_from_an_earlier_requests_output(params, expected):
    """The global trie learns a finished output while the devices run later steps; a request
    that repeats it (same prompt, greedy) then takes far fewer steps than tokens."""
    engine = engine_on(params, 1, 2, mode="tp", speculative=SpeculativeConfig(
        "suffix", num_speculative_tokens=K, disable_by_batch_size=None, suffix_min_token_prob=0.0))
    prompt, max_tokens = PROMPTS[2], MAX_TOKENS[2]  # a prompt with nothing to look up in itself
    first = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    engine.run_until_done([first])
    assert first.output_ids == expected[2]
    accepted_before = engine.snapshot().speculative.num_accepted_tokens
    again = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    engine.run_until_done([again])
    assert again.output_ids == expected[2] and engine.scheduler.drafter.num_cached_outputs >= 1
    assert engine.snapshot().speculative.num_accepted_tokens - accepted_before >= len(expected[2]) // 2
    assert len(again.modes) < len(first.modes) // 2 + 2


class CountingDrafter:
    """Never finds a draft; counts how often it is asked."""

    def __init__(self):
        self.calls = 0

    def propose(self, request, max_tokens):
        self.calls += 1
        return []

    def finish(self, request):
        pass

    def learn_pending(self, done):
        pass


def test_an_engine_that_finds_nothing_to_draft_schedules_ahead_again(params, expected):
    """Drafting needs the step before committed (no async scheduling); where the drafter
    finds nothing, the engine backs off: after each such try, 1, 2, 4 .. 16 turns ahead."""
    engine = engine_on(params, 1, 2, mode="tp", num_pages=40)
    drafter = engine.scheduler.drafter = CountingDrafter()
    request = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=60, ignore_eos=True))
    engine.run_until_done([request])
    assert len(request.output_ids) == 60
    assert 0 < drafter.calls <= 8  # tries at turns 1, 3, 6, 11, 20, 37, 54 (and the skips between)
    assert engine.snapshot().speculative.num_drafts == 0
