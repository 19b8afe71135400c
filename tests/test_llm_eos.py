"""End of sequence through ``LLM.generate``: a request that samples the tokenizer's EOS stops
there with finish_reason "stop", keeps the EOS as its last output token (as
``Scheduler.commit`` records it) and leaves it out of the text; ``ignore_eos`` runs on.

A tiny random Llama checkpoint (with tokenizer) is edited so that greedy decoding reaches
EOS: the lm_head row of ``</s>`` (id 2) becomes a scaled copy of the row of a token that
greedy decoding emits with a positive logit, so ``</s>`` wins where that token would have.
transformers' ``generate`` on the same edited weights is the oracle.
"""

import pytest
import torch
from hf_tiny import make_tiny_hf_checkpoint

EOS = 2
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def edited_checkpoint(tmp_path_factory):
    """``(shiftjax checkpoint dir, prompt ids, transformers' output ending at EOS)``."""
    from shiftjax.checkpoints import convert_hf_checkpoint

    root = tmp_path_factory.mktemp("eos")
    hf_dir, model = make_tiny_hf_checkpoint(root / "hf", "llama", with_tokenizer=True, seed=3)
    prompt = [1, 5, 6, 7, 8]  # "<s> w5 w6 w7 w8"
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    # The first new token from the third on whose logit is positive and that has not
    # appeared before: EOS will take its place there.
    index = next(i for i, t in enumerate(tokens) if i >= 2 and t != EOS and t not in tokens[:i]
                 and EOS not in tokens[:i] and out.logits[i][0, t] > 0)
    with torch.no_grad():
        model.lm_head.weight[EOS] = 3.0 * model.lm_head.weight[tokens[index]]
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
    assert EOS in expected and len(expected) < NEW_TOKENS, "the edit did not make greedy decoding reach EOS"
    model.save_pretrained(hf_dir)
    ckpt = convert_hf_checkpoint(hf_dir, root / "ckpt", dtype="float32")
    return ckpt, prompt, expected


def test_a_request_ending_at_eos_stops_there(edited_checkpoint):
    import shiftjax
    from shiftjax import SamplingParams

    ckpt, prompt, expected = edited_checkpoint
    lines = []
    llm = shiftjax.LLM(str(ckpt), dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
                       token_buckets=(4, 16), seq_buckets=(2,), attention="reference", report=lines.append)
    assert EOS in llm.engine.eos_token_ids
    # start-up reports its phases: the weights (LLM), then the engine's
    assert lines[0] == f"weights ready in {llm.load_seconds:.1f} s (orbax)" and llm.load_seconds > 0
    assert lines[1] == "quantization none: every weight float32"
    assert lines[-1].startswith("start-up: kv cache ") and " executables " in lines[-1]
    stops, runs_on = llm.generate([prompt, prompt], [SamplingParams(max_tokens=NEW_TOKENS),
                                                      SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)])
    assert stops.output_ids == expected and stops.output_ids[-1] == EOS
    assert stops.finish_reason == "stop"
    assert stops.text == llm.tokenizer.decode(expected[:-1]) and "</s>" not in stops.text
    assert len(stops.logprobs) == len(expected)
    # The same prompt with ignore_eos: the same tokens up to EOS, then on to max_tokens.
    assert runs_on.output_ids[:len(expected)] == expected
    assert len(runs_on.output_ids) == NEW_TOKENS and runs_on.finish_reason == "length"
