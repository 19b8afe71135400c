"""Issue 28's accuracy check: the default model (SmolLM2-135M-Instruct) with FP8 weights
(and an FP8 KV cache) against float32, over a few thousand tokens of real text.

Each text (the repository's own prose: README and docs) is tokenized and run through the
step function in chunks, with every position's next-token distribution read out (a step's
``sample_index`` names every row). Per variant: the mean KL divergence KL(float32 || variant)
of those distributions, the share of positions whose argmax agrees with float32's, and the
same for bf16 weights as the peer a reader knows. Deterministic; runs on the CPU.

    .venv/bin/python benchmarks/fp8_accuracy.py --out benchmarks/results/fp8_accuracy_cpu
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shiftjax.batch import empty_batch
from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.load import load_tokenizer, load_weights
from shiftjax.layouts.mesh import make_mesh
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("README.md", "docs/architecture.md", "docs/speculative_decoding.md")
CHUNK, PAGE = 128, 16
VARIANTS = {  # name -> (weights dtype, quantization, cache dtype)
    "float32": ("float32", "none", "float32"),
    "bf16": ("bfloat16", "none", "bfloat16"),
    "fp8_weights": ("float32", "fp8", "float32"),
    "fp8_weights_bf16": ("bfloat16", "fp8", "bfloat16"),
    "fp8_weights_fp8_kv": ("bfloat16", "fp8", "float8_e4m3fn"),
}


def log_probs_over(weights, token_ids: list[int], cache_dtype: str) -> np.ndarray:
    """``[len - 1, vocab]`` float32 log-probabilities of each next token, chunk by chunk
    over one sequence whose pages fill in order (a chunk attends to the ones before)."""
    mesh, config = weights.mesh, weights.config
    max_pages = -(-len(token_ids) // PAGE)
    caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(num_pages=max_pages + 1, page_size=PAGE, dtype=cache_dtype))
    step = make_step(weights, "tp", StepOptions(attention="reference"), return_logits=True)
    rows = []
    for first in range(0, len(token_ids) - 1, CHUNK):
        chunk = token_ids[first:first + CHUNK]
        batch = empty_batch(CHUNK, CHUNK, max_pages)
        n = len(chunk)
        positions = np.arange(first, first + n)
        batch.token_ids[:n], batch.positions[:n] = chunk, positions
        batch.slot_mapping[:n] = (1 + positions // PAGE) * PAGE + positions % PAGE  # pages 1.. in order
        batch.query_start[1:] = n
        batch.seq_lens[0] = first + n
        batch.page_table[0] = np.arange(1, max_pages + 1)
        batch.sample_index[:n] = np.arange(n)  # every row's distribution
        out, caches = step(weights.tp, caches, jax.tree.map(jnp.asarray, batch))
        rows.append(np.asarray(jax.nn.log_softmax(out.logits[:n].astype(jnp.float32), axis=-1)))
    return np.concatenate(rows)[:len(token_ids) - 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens-per-text", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true", help="40 tokens of one text, float32 against FP8")
    args = parser.parse_args()
    variants, texts_read = VARIANTS, TEXTS
    if args.smoke:
        args.tokens_per_text, texts_read = 40, TEXTS[:1]
        variants = {name: VARIANTS[name] for name in ("float32", "fp8_weights")}
    tokenizer = load_tokenizer(default_model_path())
    texts = {name: tokenizer.encode((ROOT / name).read_text(), add_special_tokens=True)[:args.tokens_per_text]
             for name in texts_read}
    mesh = make_mesh(1, 1)
    reference: dict[str, np.ndarray] = {}
    result = {"model": "SmolLM2-135M-Instruct (the default model)", "texts": {k: len(v) for k, v in texts.items()},
              "variants": {}}
    for variant, (dtype, quantization, cache_dtype) in variants.items():
        started = time.perf_counter()
        _, weights = load_weights("default", mesh=mesh, dtype=dtype, quantization=quantization)
        kl, agree, positions = 0.0, 0, 0
        for name, ids in texts.items():
            logp = log_probs_over(weights, ids, cache_dtype)
            if variant == "float32":
                reference[name] = logp
                continue
            ref = reference[name]
            kl += float(np.sum(np.exp(ref) * (ref - logp)))
            agree += int(np.sum(ref.argmax(-1) == logp.argmax(-1)))
            positions += len(ref)
        if variant != "float32":
            result["variants"][variant] = {
                "weights_dtype": dtype, "quantization": quantization, "kv_cache_dtype": cache_dtype,
                "positions": positions, "mean_kl_nats": kl / positions, "greedy_agreement": agree / positions,
                "seconds": round(time.perf_counter() - started, 1)}
            print(variant, json.dumps(result["variants"][variant]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_accuracy.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
