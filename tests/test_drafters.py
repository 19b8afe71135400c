"""The draft-free drafters (serving/engine/ngram_drafter.py, suffix_drafter.py): their
behaviour on hand-made sequences, and on random ones against references written the
obvious way (searching the whole history every call)."""

import collections
import dataclasses
import math
import random

import pytest
from shiftjax.serving.engine.ngram_drafter import NgramDrafter
from shiftjax.serving.engine.speculative import SpeculativeConfig
from shiftjax.serving.engine.suffix_drafter import SuffixDrafter


@dataclasses.dataclass
class Req:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)


def suffix_drafter(max_depth=24, max_cached_requests=0, min_token_prob=0.0, max_spec_factor=4.0):
    return SuffixDrafter(max_depth=max_depth, max_cached_requests=max_cached_requests,
                         min_token_prob=min_token_prob, max_spec_factor=max_spec_factor)


def learn(drafter, request_id, output, prompt=(0,)):
    """A request with ``output`` that ends, so that ``drafter`` learns it."""
    drafter.finish(Req(request_id, list(prompt), list(output)))
    drafter.learn_pending()


def occurs_in(draft, source):
    return any(source[i:i + len(draft)] == draft for i in range(len(source) - len(draft) + 1))


def trie_contents(trie):
    """{path: count} of a suffix_drafter._Trie, walked by its sibling links, after checking
    that its child dicts hold exactly those nodes and that every known best child is one."""
    paths, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        children, child = [], trie.first_child[node]
        while child != -1:
            children.append(child)
            stack.append((child, path + (trie.token[child],)))
            paths[path + (trie.token[child],)] = trie.count[child]
            child = trie.next_sibling[child]
        if trie.best[node] != -1:
            assert trie.best[node] == min(children, key=lambda c: (-trie.count[c], trie.token[c]))
    assert sum(len(shard) for shard in trie.child_of) == len(paths) == trie.num_nodes
    return paths


# The references.

def ngram_reference(tokens, min_n, max_n, max_tokens):
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        starts = [i for i in range(end - n) if tokens[i:i + n] == tokens[end - n:]]
        if n < end and starts:
            return tokens[starts[-1] + n:starts[-1] + n + max_tokens]
    return []


def next_tokens(sources, pattern):
    """What followed each occurrence of ``pattern`` in ``sources``, and how many occurrences."""
    nexts, total = collections.Counter(), 0
    for source in sources:
        for i in range(len(source) - len(pattern) + 1):
            if source[i:i + len(pattern)] == pattern:
                total += 1
                if i + len(pattern) < len(source):
                    nexts[source[i + len(pattern)]] += 1
    return nexts, total


def suffix_reference(tokens, outputs, max_depth, max_tokens, min_token_prob, max_spec_factor):
    def limit(m):
        return min(max_tokens, math.ceil(max_spec_factor * m - 1e-9))

    cap = next((m for m in range(max_depth - 1, 0, -1) if m + limit(m) <= max_depth), 0)

    def chain(sources, m, own):
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit(m):
            nexts, total = next_tokens(sources, tokens[len(tokens) - m:] + draft)
            if not nexts:
                break
            token = min(nexts, key=lambda t: (-nexts[t], t))
            # In the request's own tokens the occurrence at the end has no next token yet.
            prob *= nexts[token] / (sum(nexts.values()) if own else total)
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
        return draft, score

    best = [], 0.0
    for m in range(min(cap, len(tokens)), 0, -1):
        if next_tokens([tokens], tokens[len(tokens) - m:])[0]:
            best = chain([tokens], m, own=True)
            break
    for m in range(min(cap, len(tokens)), 0, -1):
        if next_tokens(outputs, tokens[len(tokens) - m:])[0]:
            other = chain(outputs, m, own=False)
            return other[0] if other[1] > best[1] else best[0]
    return best[0]


# NgramDrafter.

def test_ngram_prefers_the_longest_match():
    # "3 4" last followed by 7 (at the end); "2 3 4" earlier, followed by 5.
    tokens = [2, 3, 4, 5, 9, 3, 4, 7, 2, 3, 4]
    assert NgramDrafter(2, 3).propose(Req(0, tokens), 3) == [5, 9, 3]
    assert NgramDrafter(2, 2).propose(Req(0, tokens), 3) == [7, 2, 3]


def test_ngram_prefers_the_most_recent_occurrence():
    tokens = [1, 2, 5, 6, 1, 2, 7, 8, 1, 2]
    assert NgramDrafter(2, 4).propose(Req(0, tokens), 2) == [7, 8]


def test_ngram_never_matches_the_suffix_itself():
    assert NgramDrafter(1, 3).propose(Req(0, [1, 2, 3]), 3) == []
    assert NgramDrafter(1, 3).propose(Req(0, [5]), 3) == []
    assert NgramDrafter(1, 3).propose(Req(0, []), 3) == []
    # Overlapping occurrences: the continuation runs into the suffix, as the tokens stand.
    assert NgramDrafter(2, 2).propose(Req(0, [1, 2, 1, 2, 1]), 5) == [2, 1]
    assert NgramDrafter(1, 1).propose(Req(0, [7, 7]), 5) == [7]


def test_ngram_respects_min_n():
    tokens = [4, 1, 9, 8, 1]  # only "1" recurs
    assert NgramDrafter(1, 3).propose(Req(0, tokens), 2) == [9, 8]
    assert NgramDrafter(2, 3).propose(Req(0, tokens), 2) == []


def test_ngram_respects_max_tokens():
    request = Req(0, [1, 2, 3, 4, 5, 6, 1, 2])
    drafter = NgramDrafter(2, 2)
    assert drafter.propose(request, 0) == []
    assert drafter.propose(request, 1) == [3]
    assert drafter.propose(request, 3) == [3, 4, 5]
    assert drafter.propose(request, 16) == [3, 4, 5, 6, 1, 2]  # shorter: the tokens end


def test_ngram_incremental_matches_from_scratch_and_finish_frees_state():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(300)]
    drafter = NgramDrafter(1, 4)
    request = Req(7, tokens[:40])
    while len(request.prompt_ids) + len(request.output_ids) < len(tokens):
        seen = len(request.prompt_ids) + len(request.output_ids)
        request.output_ids += tokens[seen:seen + rng.randint(1, 4)]
        whole = request.prompt_ids + request.output_ids
        assert drafter.propose(request, 5) == NgramDrafter(1, 4).propose(Req(8, whole), 5)
    assert drafter.num_requests == 1
    drafter.finish(request)
    drafter.finish(Req(99, [1]))  # never proposed for: nothing to drop, no error
    assert drafter.num_requests == 0


def test_ngram_matches_reference_on_random_tokens():
    rng = random.Random(1)
    for trial in range(40):
        min_n, max_n = sorted((rng.randint(1, 4), rng.randint(1, 4)))
        drafter, request = NgramDrafter(min_n, max_n), Req(trial, [])
        for _ in range(60):
            request.output_ids += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
            max_tokens = rng.randint(0, 6)
            draft = drafter.propose(request, max_tokens)
            tokens = request.prompt_ids + request.output_ids
            assert draft == ngram_reference(tokens, min_n, max_n, max_tokens)
            assert occurs_in(draft, tokens)


# SuffixDrafter.

def test_suffix_drafts_like_prompt_lookup_on_a_repeat():
    request = Req(0, [1, 2, 3, 4, 1, 2, 3])
    assert suffix_drafter(max_spec_factor=1.0).propose(request, 8) == [4, 1, 2]  # 3 = the match's length
    assert suffix_drafter(max_spec_factor=2.0).propose(request, 8) == [4, 1, 2, 3]  # the tokens end
    # The whole-text match sits one short of the depth of 8; a shorter one leaves room for the draft.
    text = list(range(10, 30))
    assert suffix_drafter(max_depth=8, max_spec_factor=1.0).propose(Req(0, text + text[:12]), 3) == text[12:15]


def test_suffix_prefers_the_most_frequent_continuation():
    drafter = suffix_drafter()
    # After 9: 1 twice, then 2 (most recent: prompt lookup would say 2).
    assert drafter.propose(Req(0, [9, 1, 9, 1, 9, 2, 9]), 1) == [1]
    assert drafter.propose(Req(1, [9, 3, 9, 2, 9]), 1) == [2]  # a tie: the smaller token


def test_suffix_min_token_prob_cuts_the_chain():
    # After "7": 1 (twice), 2; after "7 1": 5, then 5 6 or 5 8.
    tokens = [7, 1, 5, 6, 7, 1, 5, 8, 7, 2, 7]
    drafts = {p: suffix_drafter(min_token_prob=p).propose(Req(0, tokens), 4) for p in (0.0, 0.5, 0.7)}
    assert drafts == {0.0: [1, 5, 6, 7], 0.5: [1, 5], 0.7: []}


def test_suffix_max_spec_factor_limits_the_draft_to_the_match():
    tokens = [5, 1, 2, 3, 4, 9, 5]  # the match is "5" alone
    assert suffix_drafter(max_spec_factor=1.0).propose(Req(0, tokens), 8) == [1]
    assert suffix_drafter(max_spec_factor=3.0).propose(Req(0, tokens), 8) == [1, 2, 3]
    assert suffix_drafter(max_spec_factor=2.5).propose(Req(0, tokens), 8) == [1, 2, 3]  # ceil
    assert suffix_drafter(max_spec_factor=3.0).propose(Req(0, tokens), 2) == [1, 2]
    # A factor computed as 0.1 * 3 times 10 is 3.0000000000000004: still 3 after a match of 10.
    tokens = [99] + list(range(10)) + [20, 21, 22, 23, 24] + list(range(10))
    assert suffix_drafter(max_spec_factor=0.1 * 3).propose(Req(0, tokens), 8) == [20, 21, 22]
    assert suffix_drafter().propose(Req(0, tokens), 0) == []


def test_suffix_global_trie_drafts_an_earlier_output():
    drafter = suffix_drafter(max_cached_requests=4, max_spec_factor=1.0)
    learn(drafter, 0, [10, 11, 12, 13, 14, 15])
    assert drafter.num_cached_outputs == 1
    request = Req(1, [50, 51, 10, 11, 12])
    assert drafter.propose(request, 8) == [13, 14, 15]
    # Its own history wins where it knows as much: 11 12 -> 40 here, with probability 1.
    assert drafter.propose(Req(2, [11, 12, 40, 11, 12]), 8) == [40, 11]
    # "4 2 3" ends that output, with nothing after it: the match is the shorter "2 3".
    learn(drafter, 3, [1, 2, 3, 4, 2, 3])
    assert drafter.propose(Req(4, [9, 4, 2, 3]), 8) == [4, 2]
    # Without a global trie nothing is learned.
    none = suffix_drafter(max_cached_requests=0)
    learn(none, 0, [10, 11, 12, 13])
    assert none.propose(Req(1, [10, 11]), 4) == [] and none.num_global_nodes == 0


def test_suffix_evicts_the_oldest_output():
    drafter = suffix_drafter(max_cached_requests=2, max_spec_factor=1.0)
    outputs = {"a": [20, 21, 22, 23], "b": [30, 31, 7, 1, 7, 1, 7], "c": [40, 41, 7, 2]}
    learn(drafter, 0, outputs["a"])
    learn(drafter, 1, outputs["b"])
    assert drafter.propose(Req(5, [20, 21]), 2) == [22, 23]
    assert drafter.propose(Req(6, [7]), 1) == [1]
    learn(drafter, 2, outputs["c"])  # a goes
    assert drafter.num_cached_outputs == 2
    assert drafter.propose(Req(5, [20, 21]), 2) == []
    only_b_and_c = suffix_drafter(max_cached_requests=2)
    learn(only_b_and_c, 1, outputs["b"])
    learn(only_b_and_c, 2, outputs["c"])
    assert trie_contents(drafter._global) == trie_contents(only_b_and_c._global)
    learn(drafter, 3, [8, 8])  # b goes: after 7, 2 is now the most frequent (a count fell)
    assert drafter.propose(Req(6, [7]), 1) == [2]
    assert drafter.num_global_nodes == 4 + 3 + 2 + 1 + 2  # 40 41 7 2, 41 7 2, 7 2, 2; 8 8 (8 is its prefix)
    learn(drafter, 4, [1])
    learn(drafter, 5, [1])
    assert drafter.num_global_nodes == 1


def test_suffix_global_trie_after_evictions():
    drafter = suffix_drafter(max_cached_requests=2, max_spec_factor=1.0)
    learn(drafter, 0, [7, 1, 7, 1])
    learn(drafter, 1, [7, 4, 7, 9])
    learn(drafter, 2, [8])  # the first goes: after 7, 4 and 9 tie and the smaller wins
    assert drafter.propose(Req(3, [7]), 1) == [4]
    # Freed nodes are reused: 50 outputs of 5 new tokens (15 nodes each), 3 held at most.
    for request_id in range(4, 54):
        learn(drafter, request_id, list(range(100 + 5 * request_id, 105 + 5 * request_id)))
    assert drafter.num_global_nodes == 30 and len(drafter._global.count) <= 1 + 45 + 8


def test_suffix_incremental_matches_from_scratch_and_finish_frees_state():
    rng = random.Random(2)
    tokens = [rng.randrange(6) for _ in range(300)]
    drafter, fresh = suffix_drafter(max_depth=6), suffix_drafter(max_depth=6)
    request = Req(3, tokens[:30])
    while len(request.prompt_ids) + len(request.output_ids) < len(tokens):
        seen = len(request.prompt_ids) + len(request.output_ids)
        request.output_ids += tokens[seen:seen + rng.randint(1, 4)]
        once = Req(100 + seen, request.prompt_ids + request.output_ids)
        assert drafter.propose(request, 6) == fresh.propose(once, 6)
        fresh.finish(once)
    assert drafter.num_requests == 1 and fresh.num_requests == 0
    drafter.finish(request)
    assert drafter.num_requests == 0


@pytest.mark.parametrize("seed", range(4))
def test_suffix_matches_reference_on_random_tokens(seed):
    rng = random.Random(seed)
    max_depth, max_cached = rng.choice([(3, 1), (6, 2), (24, 3)])
    min_token_prob, max_spec_factor = rng.choice([0.0, 0.1, 0.4]), rng.choice([0.5, 1.0, 2.5])
    drafter = SuffixDrafter(max_depth=max_depth, max_cached_requests=max_cached,
                            min_token_prob=min_token_prob, max_spec_factor=max_spec_factor)
    cached = collections.deque(maxlen=max_cached)
    for request_id in range(8):
        request = Req(request_id, [rng.randrange(5) for _ in range(rng.randint(0, 12))])
        for _ in range(rng.randint(1, 25)):
            request.output_ids += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
            max_tokens = rng.randint(0, 8)
            tokens = request.prompt_ids + request.output_ids
            draft = drafter.propose(request, max_tokens)
            assert draft == suffix_reference(tokens, list(cached), max_depth, max_tokens,
                                             min_token_prob, max_spec_factor)
            assert occurs_in(draft, tokens) or any(occurs_in(draft, output) for output in cached)
        drafter.finish(request)
        drafter.learn_pending()
        cached.append(request.output_ids)
    assert drafter.num_requests == 0 and drafter.num_cached_outputs == len(cached)
    fresh = SuffixDrafter(max_depth=max_depth, max_cached_requests=max_cached,
                          min_token_prob=min_token_prob, max_spec_factor=max_spec_factor)
    for request_id, output in enumerate(cached):
        learn(fresh, request_id, output)
    assert trie_contents(drafter._global) == trie_contents(fresh._global)


def test_speculative_config_makes_both_drafters():
    ngram = SpeculativeConfig("ngram", prompt_lookup_min=1).make_drafter()
    assert isinstance(ngram, NgramDrafter) and ngram.min_n == 1
    suffix = SpeculativeConfig("suffix", suffix_max_depth=8).make_drafter()
    assert isinstance(suffix, SuffixDrafter) and suffix.max_depth == 8


def test_suffix_learns_finished_outputs_a_part_at_a_time_when_asked():
    """finish only queues an output (learning one is ~45 ms a 1k tokens, the engine's
    thread would stall); learn_pending learns LEARN_CHUNK positions a call while ``done()``
    says the devices are still busy, at least one part a call, and evicts the same way."""
    from shiftjax.serving.engine.suffix_drafter import LEARN_CHUNK

    drafter, whole = suffix_drafter(max_depth=4, max_cached_requests=1), suffix_drafter(max_depth=4, max_cached_requests=1)
    first, second = list(range(10, 10 + 3 * LEARN_CHUNK)), list(range(500, 500 + LEARN_CHUNK + 3))
    drafter.finish(Req(0, [1], first))
    assert drafter.num_global_nodes == 0 and drafter.num_pending == 1
    calls = 0
    while drafter.num_pending:
        drafter.learn_pending(lambda: True)  # the step is done at once: one part a call
        calls += 1
    assert calls == 3
    learn(whole, 0, first)
    assert trie_contents(drafter._global) == trie_contents(whole._global)
    drafter.finish(Req(1, [1], second))
    drafter.learn_pending()  # all of it: learns the second, then forgets the first (one output kept)
    learn(whole, 1, second)
    assert trie_contents(drafter._global) == trie_contents(whole._global)
    assert drafter.num_cached_outputs == 1 and drafter.propose(Req(2, [500, 501]), 3) == [502, 503, 504]
