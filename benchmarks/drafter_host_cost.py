"""Host time of the draft-free drafters (serving/engine/ngram_drafter.py, suffix_drafter.py).

``propose`` runs once per engine step for every speculating request, on the engine's
critical path. This times it in the steady state (one token arrived since the last call,
as in decoding) at context lengths of 1k and 8k tokens and drafts of 3 and 8 tokens, with
the configuration's defaults (prompt lookup 2 to 5; suffix depth 24, min_token_prob 0.1,
max_spec_factor 1.0; the global trie full, with the last 64 outputs of 1k tokens). Also: the
first call (it indexes the whole prompt), ``finish`` of a 1k-token output (the suffix
drafter learns it into the global trie and evicts the oldest one), and memory (tracemalloc,
in separate passes): a request's state at 8k tokens, the global trie's per output learned.

The tokens are synthetic text: Zipf-distributed over a 32k vocabulary, with a third of
them in spans copied from earlier (5 to 30 tokens), so that both drafters find matches.

    .venv/bin/python benchmarks/drafter_host_cost.py --out benchmarks/results/drafter_host_cost_cpu.json

made benchmarks/results/drafter_host_cost_cpu.json (the 2-core CPU of the development
machine, CPython 3.11, shared with other sessions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np
from shiftjax.serving.engine.speculative import SpeculativeConfig
from shiftjax.serving.engine.suffix_drafter import SuffixDrafter

VOCAB = 32_000
CONTEXTS = (1024, 8192)
DRAFT_LENGTHS = (3, 8)
CACHED_OUTPUTS = 64
CACHED_OUTPUT_LENGTH = 1024


@dataclasses.dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)


def synthetic_text(rng: np.random.Generator, length: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) > 64 and rng.random() < 1 / 3 / 17:  # a copy averages 17 tokens: a third copied
            span = int(rng.integers(5, 31))
            start = int(rng.integers(0, len(tokens) - span))
            tokens += tokens[start:start + span]
        else:
            tokens.append(int(min(rng.zipf(1.2), VOCAB)) - 1)
    return tokens[:length]


def make_drafters(seed: int) -> dict:
    # The global trie full (as in serving, past the first max_cached_requests requests): each
    # finish then also evicts the oldest output.
    suffix = SpeculativeConfig("suffix", suffix_max_cached_requests=CACHED_OUTPUTS).make_drafter()
    rng = np.random.default_rng(seed)
    for request_id in range(CACHED_OUTPUTS):
        suffix.finish(Request(-1 - request_id, [0], synthetic_text(rng, CACHED_OUTPUT_LENGTH)))
    suffix.learn_pending()
    return {"ngram": SpeculativeConfig("ngram").make_drafter(), "suffix": suffix}


def time_drafter(drafter, context: int, draft_length: int, calls: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = synthetic_text(rng, context + calls)
    request = Request(seed, tokens[:context])
    start = time.perf_counter_ns()
    drafter.propose(request, draft_length)
    first_ms = (time.perf_counter_ns() - start) / 1e6
    per_call_us, drafted = [], 0
    for token in tokens[context:]:
        request.output_ids.append(token)
        start = time.perf_counter_ns()
        draft = drafter.propose(request, draft_length)
        per_call_us.append((time.perf_counter_ns() - start) / 1e3)
        drafted += bool(draft)
    drafter.finish(request)
    per_call_us.sort()
    return {"us_per_call_mean": round(statistics.fmean(per_call_us), 2),
            "us_per_call_median": round(per_call_us[len(per_call_us) // 2], 2),
            "us_per_call_p99": round(per_call_us[int(len(per_call_us) * 0.99)], 2),
            "first_call_ms": round(first_ms, 2), "calls_with_a_draft": drafted / calls}


def time_finish(drafter: SuffixDrafter, seed: int, repeats: int = 8) -> float:
    """Milliseconds per ``finish`` of a request with a 1k-token output (the trie is full: each
    also evicts the oldest output)."""
    rng = np.random.default_rng(seed)
    elapsed = []
    for i in range(repeats):
        request = Request(10_000 + i, [0], synthetic_text(rng, CACHED_OUTPUT_LENGTH))
        start = time.perf_counter_ns()
        drafter.finish(request)
        drafter.learn_pending()  # all of it now (the engine spreads it over steps' device time)
        elapsed.append((time.perf_counter_ns() - start) / 1e6)
    return round(statistics.fmean(elapsed), 2)


def state_bytes(drafter, context: int, seed: int) -> int:
    """Bytes allocated by the first ``propose`` of a request of ``context`` tokens: its state."""
    request = Request(seed, synthetic_text(np.random.default_rng(seed), context))
    tracemalloc.start()
    drafter.propose(request, 3)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    drafter.finish(request)
    return size


def global_trie_bytes_per_output(seed: int, outputs: int = 16) -> int:
    """Bytes the global trie grows by per 1k-token output it learns (tracemalloc)."""
    rng = np.random.default_rng(seed)
    requests = [Request(i, [0], synthetic_text(rng, CACHED_OUTPUT_LENGTH)) for i in range(outputs)]
    drafter = SpeculativeConfig("suffix").make_drafter()
    tracemalloc.start()
    for request in requests:
        drafter.finish(request)
        drafter.learn_pending()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size // outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="timed propose calls per configuration")
    parser.add_argument("--out", help="also write the JSON here (a directory: drafter_host_cost.json in it)")
    parser.add_argument("--smoke", action="store_true", help="10 calls a configuration (the code path, not the numbers)")
    args = parser.parse_args()
    if args.smoke:
        args.calls = 10
    if args.out and os.path.isdir(args.out):
        args.out = os.path.join(args.out, "drafter_host_cost.json")
    drafters = make_drafters(seed=0)
    results = {"python": platform.python_version(), "machine": platform.machine(), "calls": args.calls,
               "load_average_before": os.getloadavg()[0], "us_per_call_mean": {}, "detail": {}}
    for name, drafter in drafters.items():
        for context in CONTEXTS:
            for draft_length in DRAFT_LENGTHS:
                key = f"{name}/context={context}/draft={draft_length}"
                timing = time_drafter(drafter, context, draft_length, args.calls, seed=context + draft_length)
                results["us_per_call_mean"][key] = timing["us_per_call_mean"]
                results["detail"][key] = timing
    results["suffix_learn_ms_per_1k_token_output"] = time_finish(drafters["suffix"], seed=1)
    results["suffix_global_trie_nodes"] = drafters["suffix"].num_global_nodes
    results["suffix_global_trie_bytes_per_1k_token_output"] = global_trie_bytes_per_output(seed=3)
    results["state_bytes_at_8k_tokens"] = {name: state_bytes(drafter, 8192, seed=2)
                                           for name, drafter in drafters.items()}
    results["load_average_after"] = os.getloadavg()[0]
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
