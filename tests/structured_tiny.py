"""A tiny model with a real tokenizer for structured-output tests: 96 tokens, one printable
ASCII character each (a byte-level BPE with no merges, which llguidance reads like any
Hugging Face tokenizer), ``</s>`` (id 2) the only special token; and the reference the
engine must equal: greedy decoding by transformers with each step's logits masked by a
fresh llguidance matcher."""

from __future__ import annotations

import numpy as np
import torch
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from shiftjax.config import ModelConfig
from shiftjax.serving.engine.grammar import GrammarCompiler, GrammarState, MaskFiller, allow_all
from shiftjax.serving.engine.sampling_params import SamplingParams

EOS = 2
CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(EOS,))
# 93 printable characters (not ` and ~), space as byte-level BPE spells it
CHARACTERS = [chr(c) for c in range(32, 127) if chr(c) not in "`~"]


def tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": EOS} | {("Ġ" if c == " " else c): 3 + i for i, c in enumerate(CHARACTERS)}
    assert len(vocab) == CONFIG.vocab_size
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tiny_compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer().to_str(), CONFIG.vocab_size, (EOS,))


def masked_greedy(model, compiler: GrammarCompiler, prompt: list[int], params: SamplingParams
                  ) -> tuple[list[int], str]:
    """What the engine must generate: each step, transformers' logits of the whole sequence,
    the grammar's forbidden tokens at -inf, the argmax; ended as the scheduler ends a
    request (end of sequence, then a forbidden token, the grammar complete, max_tokens)."""
    state = None if params.structured_outputs is None else GrammarState(compiler.compile(params.structured_outputs))
    eos = () if params.ignore_eos else (EOS,)
    filler, tokens = MaskFiller(), list(prompt)
    while True:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].numpy().astype(np.float64)
        if state is not None:
            bitmask = allow_all(1, CONFIG.vocab_size)
            filler.fill(bitmask, [(state, 0)])
            allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:CONFIG.vocab_size].astype(bool)
            logits = np.where(allowed, logits, -np.inf)
        token = int(np.argmax(logits))
        tokens.append(token)
        output = tokens[len(prompt):]
        if token in eos:
            return output, "stop"
        if state is not None and not state.accept(token):
            return output, "error"
        if state is not None and state.terminated:
            return output, "stop"
        if len(output) >= params.max_tokens:
            return output, "length"
