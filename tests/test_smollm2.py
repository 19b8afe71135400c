"""SmolLM2-135M-Instruct end to end: shiftjax greedy decoding equals transformers on the same GGUF."""

from __future__ import annotations

import pytest

from hf_tiny import load_hf_smollm2_gguf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
NEW_TOKENS = 20

@pytest.fixture(scope="module")
def llm():
    import shiftjax

    # Two small buckets keep the ahead-of-time compilation short on a CPU.
    return shiftjax.LLM("default", dtype="float32", max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=32, token_buckets=(4, 32), seq_buckets=(4,))


@pytest.fixture(scope="module")
def hf_model_and_tokenizer():
    return load_hf_smollm2_gguf()


@pytest.mark.slow
def test_greedy_continuations_match_transformers(llm, hf_model_and_tokenizer):
    import torch

    from shiftjax import SamplingParams

    model, tokenizer = hf_model_and_tokenizer
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    completions = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, ids, completion in zip(PROMPTS, prompt_ids, completions):
        assert completion.prompt_ids == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        assert len(expected) == NEW_TOKENS
        assert completion.output_ids == expected, (prompt, tokenizer.decode(expected), completion.text)


@pytest.mark.slow
def test_chat_answers_a_short_question(llm):
    from shiftjax import SamplingParams

    [completion] = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=24), chat=True)
    assert "Paris" in completion.text
