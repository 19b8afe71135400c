"""Structured outputs, measured in the engine's own loop (issue 29): TPOT of concurrent
JSON-schema requests against unconstrained ones and of a batch mixing both, with
asynchronous scheduling on and off (a constrained step's sampling waits for the previous
step's commit: core.py's docstring); the host time the masks add per step, from the
engine's counters; and the compile time of each schema below with the model's tokenizer.

    python3 -P benchmarks/structured_outputs.py --model benchmarks/configs/Llama-3.1-8B \
        --tokenizer benchmarks/configs/smollm2-tokenizer --out DIR          # on the H200
    python benchmarks/structured_outputs.py --smoke --out DIR              # the CPU, default model

``--parts unconstrained`` runs only what an engine without structured outputs can (the tree
before them, for a before/after in one call). Dummy weights generate random tokens, so a
constrained row's grammar walks wherever they lead; the schemas keep it generating (an
unbounded string) until max_tokens, as unconstrained rows do with ignore_eos.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

# a dozen schemas of increasing difficulty, for their compile times
SCHEMAS = {
    "string": {"type": "string"},
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "required": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bounded": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                                                 "count": {"type": "integer", "minimum": 1}}},
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": {"type": "string", "format": "email"}}, "required": ["id"]}}},
    "array_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": {"type": "integer"}},
        "required": ["sku", "qty"]}},
    "any_of": {"anyOf": [{"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"]},
                         {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"]}]},
    "defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}},
    "recursive": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
    "tool_call": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"]}}, "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"const": "search"}, "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
         "required": ["name", "parameters"]}]}},
}
# what the timed constrained rows generate: an object whose one field is an unbounded string
LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def timed_run(engine, prompts, params_list, async_scheduling: bool) -> dict:
    """Runs the requests to the end in the engine's loop; per request, the seconds between
    its tokens (TPOT, from its second token on)."""
    engine.config = dataclasses.replace(engine.config, async_scheduling=async_scheduling)  # read per turn
    before = engine.snapshot()
    requests = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    times = {id(r): [] for r in requests}
    started = time.perf_counter()
    steps = 0
    while not all(r.finished for r in requests):
        report = engine.run_step()
        if report is None:
            raise RuntimeError("requests are unfinished but no step can be scheduled")
        now = time.perf_counter()
        steps += 1
        for request, sampled in zip(report.requests, report.sampled):
            if sampled and id(request) in times:
                times[id(request)].append(now)
    while engine.has_work:  # the step left in flight
        engine.run_step()
    after = engine.snapshot()
    tpots = {True: [], False: []}  # constrained or not: TPOT from the second token on
    for r in requests:
        t = times[id(r)]
        if len(t) > 2:
            tpots[getattr(r.params, "structured_outputs", None) is not None].append((t[-1] - t[1]) / (len(t) - 2))
    # (getattr: the tree before structured outputs has no grammar counters)
    grammar_before, grammar_after = getattr(before, "grammar", None), getattr(after, "grammar", None)
    fills = grammar_after.mask_fills - grammar_before.mask_fills if grammar_after else 0
    tpot = {f"{kind}_tpot_ms_{stat}": 1e3 * f(tpots[constrained])
            for kind, constrained in (("constrained", True), ("unconstrained", False)) if tpots[constrained]
            for stat, f in (("p50", statistics.median), ("mean", statistics.fmean))}
    return {
        "requests": len(requests), "async_scheduling": async_scheduling, "steps": steps,
        "seconds": time.perf_counter() - started, **tpot,
        "output_tokens": sum(len(r.output_ids) for r in requests),
        "finish_reasons": sorted({r.finish_reason for r in requests}),
        "mask_fills": fills,
        "masked_rows": grammar_after.masked_rows - grammar_before.masked_rows if grammar_after else 0,
        "mask_ms_per_fill": 1e3 * (grammar_after.mask_seconds - grammar_before.mask_seconds) / fills if fills else 0.0,
    }


def compile_times(tokenizer, vocab_size: int) -> dict:
    """Each schema's first compile (a fresh compiler each, so none is cached) and one mask
    fill from its start state, in milliseconds."""
    from shiftjax.serving.engine.grammar import GrammarCompiler, GrammarState, MaskFiller, allow_all
    from shiftjax.serving.engine.structured_outputs import StructuredOutputs

    warm = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)
    started = time.perf_counter()
    warm.compile(StructuredOutputs(json_object=True))  # the tokenizer's one-off set-up
    out = {"tokenizer_setup_ms": 1e3 * (time.perf_counter() - started)}
    filler = MaskFiller()
    for name, schema in SCHEMAS.items():
        compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)
        compiler._llg_tokenizer = warm._llg_tokenizer  # the same tokenizer, set up once
        compiled = compiler.compile(StructuredOutputs.from_json_schema(schema))
        bitmask = allow_all(1, vocab_size)
        started = time.perf_counter()
        filler.fill(bitmask, [(GrammarState(compiled), 0)])
        out[name] = {"compile_ms": 1e3 * compiled.seconds, "first_mask_ms": 1e3 * (time.perf_counter() - started)}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parts", choices=("all", "unconstrained"), default="all")
    parser.add_argument("--smoke", action="store_true", help="the default model on the CPU, 4 requests of 8 tokens")
    parser.add_argument("--out", type=Path, required=True, help="a directory for structured_outputs.json")
    args = parser.parse_args()
    import shiftjax
    from shiftjax.serving.engine.sampling_params import SamplingParams

    if args.smoke:
        args.requests, args.prompt_tokens, args.max_tokens = 4, 16, 8
        llm = shiftjax.LLM("default", dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                           token_buckets=(4, 32), seq_buckets=(4,))
    else:
        llm = shiftjax.LLM(args.model, load_format="dummy" if args.model != "default" else "orbax",
                           tokenizer=args.tokenizer, dtype="bfloat16", mode="tp",
                           max_model_len=args.prompt_tokens + args.max_tokens + 16,
                           max_num_seqs=args.requests, max_num_batched_tokens=2048)
    engine, vocab = llm.engine, llm.config.vocab_size
    rng = np.random.default_rng(0)
    # distinct random prompts: no prefix-cache hit makes one run cheaper than another
    prompts = [rng.integers(100, min(vocab, 49152), args.prompt_tokens).tolist() for _ in range(args.requests)]
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=1)
    runs = {}

    def run(name, params_list, async_scheduling=True, count=args.requests):
        runs[name] = timed_run(engine, prompts[:count], params_list[:count], async_scheduling)
        print(name, json.dumps(runs[name]), flush=True)

    run("warm-up", [plain] * args.requests)
    run("unconstrained_1", [plain], count=1)
    run("unconstrained", [plain] * args.requests)
    run("unconstrained_sampled", [sampled] * args.requests)
    run("unconstrained_sync", [plain] * args.requests, async_scheduling=False)
    result = {"model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "runs": runs}
    if args.parts == "all":
        from shiftjax.serving.engine.structured_outputs import StructuredOutputs

        constrained = dataclasses.replace(plain, structured_outputs=StructuredOutputs.from_json_schema(LONG_SCHEMA))
        run("json_schema_1", [constrained], count=1)
        run("json_schema", [constrained] * args.requests)
        run("mixed", [constrained, plain] * (args.requests // 2))
        run("json_schema_sync", [constrained] * args.requests, async_scheduling=False)
        result["compile"] = compile_times(llm.tokenizer, vocab)
        print("compile", json.dumps(result["compile"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_outputs.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
