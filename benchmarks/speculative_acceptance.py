"""Issue 30: how much of a draft the default model accepts on real text, greedy, for each
drafting method and draft length, on workloads that repeat their context and one that does
not (``speculative_workloads.py``). Acceptance is the model's and the drafter's, not the
hardware's: the CPU measures it exactly (a greedy output is the same on any device).

    python benchmarks/speculative_acceptance.py --out DIR            # the default model, on the CPU
    python benchmarks/speculative_acceptance.py --smoke --out DIR    # a few tokens of one workload

The requests of a workload run one after another (as a user's turns would), so that suffix
decoding's tree of earlier outputs sees the ones before. Writes ``speculative_acceptance.json``:
per method, draft length and workload the mean accepted length (tokens a verified draft's
step gives: the accepted ones and the one sampled after them, vLLM's "mean acceptance
length"), the acceptance rate, the tokens per decode step over all of a request's steps
(drafted or not), and whether every output equals the output without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from speculative_workloads import workloads  # noqa: E402


def run_workload(llm, conversations, max_tokens: int) -> dict:
    """Runs the conversations one by one; their outputs and what the engine counted."""
    from shiftjax.serving.engine.sampling_params import SamplingParams

    engine, outputs, decode_steps = llm.engine, [], 0
    before = engine.snapshot().speculative
    started = time.perf_counter()
    for messages in conversations:
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        completion = llm.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
        outputs.append(completion.output_ids)
        prefill_steps = -(-len(prompt) // engine.limits.max_num_batched_tokens)
        decode_steps += len(completion.modes) - prefill_steps
    after = engine.snapshot().speculative
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "output_tokens": tokens, "decode_steps": decode_steps,
            "tokens_per_decode_step": round((tokens - len(outputs)) / max(decode_steps, 1), 3),
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_position": [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)],
            "draft_ms_per_draft": round(1e3 * (after.draft_seconds - before.draft_seconds) / max(drafts, 1), 4),
            "seconds": round(time.perf_counter() - started, 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--draft-lengths", default="3")
    parser.add_argument("--smoke", action="store_true", help="one conversation of one workload, 8 tokens, K=3")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import jax

    import shiftjax

    jax.config.update("jax_platforms", "cpu")
    chosen = workloads()
    lengths = [int(k) for k in args.draft_lengths.split(",")]
    if args.smoke:
        chosen = {"code_edit": chosen["code_edit"][:1]}
        args.max_tokens, lengths = 8, [3]
    # one request at a time: a small pool (the CPU's reference attention reads every page a
    # sequence may have), rows for a draft of up to 7
    options = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, token_buckets=(8, 512),
                   seq_buckets=(8,), num_pages=80, enable_prefix_caching=False)
    plain = shiftjax.LLM("default", **options)
    result = {"max_tokens": args.max_tokens, "runs": {}}
    reference = {name: run_workload(plain, conversations, args.max_tokens) for name, conversations in chosen.items()}
    result["runs"]["none"] = {name: {k: v for k, v in run.items() if k != "outputs"} for name, run in reference.items()}
    del plain
    for method in args.methods.split(","):
        for k in lengths:
            llm = shiftjax.LLM("default", speculative=dict(method=method, num_speculative_tokens=k), **options)
            runs = {}
            for name, conversations in chosen.items():
                run = run_workload(llm, conversations, args.max_tokens)
                run["outputs_equal_no_speculation"] = run.pop("outputs") == reference[name]["outputs"]
                runs[name] = run
                print(method, k, name, json.dumps(run), flush=True)
            result["runs"][f"{method}_k{k}"] = runs
            write(args.out, result)  # after each configuration: a long run keeps what it has
    write(args.out, result)


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative_acceptance.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
