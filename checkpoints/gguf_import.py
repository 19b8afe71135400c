"""GGUF (llama.cpp) → Hugging Face directory: float32 weights, config and tokenizer.

The result is an ordinary Hugging Face model directory, which ``convert_hf_checkpoint``
then turns into a shiftjax checkpoint like any other. What the import undoes:

- quantisation: every tensor is dequantised to float32 with ``gguf.quants.dequantize``;
- llama.cpp's q/k row permutation: its converter reorders each head's rows from
  Hugging Face's rotate_half layout (first half pairs with second half) to interleaved
  pairs; we reorder them back, as ``transformers``' GGUF loader does;
- the missing ``tokenizer.json``: built from the GGUF vocabulary and merges as the
  byte-level BPE that ``transformers`` builds from the same metadata.

Supported: ``general.architecture == "llama"`` (Llama, Mistral, SmolLM2) with a ``gpt2``
(byte-level BPE) tokenizer.
"""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np

from shiftjax.checkpoints.format import CheckpointError, publish, staging_dir_for

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Pre-tokenizer split patterns for `tokenizer.ggml.pre` values whose text splitting differs
# from GPT-2's; the same table as transformers' GGUF tokenizer mapping.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# `tokenizer.ggml.pre` values that use GPT-2's own split, the ByteLevel default.
_GPT2_SPLIT_PRES = {None, "default", "gpt2", "gpt-2", "smollm", "starcoder", "refact"}


def import_gguf(gguf_path: str | Path, out_hf_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Writes a Hugging Face model directory for the GGUF file at ``gguf_path``.

    ``out_hf_dir`` gets ``config.json`` (LlamaForCausalLM), ``model.safetensors`` (float32,
    Hugging Face names and layouts), ``tokenizer.json`` and ``tokenizer_config.json`` (with
    the GGUF's chat template and special tokens). It is assembled in a temporary sibling
    directory and renamed into place when complete.
    """
    import gguf

    gguf_path, out_hf_dir = Path(gguf_path), Path(out_hf_dir)
    if out_hf_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_hf_dir} already exists; remove it or pass overwrite")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except FileNotFoundError:
        raise CheckpointError(f"{gguf_path} does not exist") from None
    except Exception as error:  # the reader raises ValueError/struct errors on bad files
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file: {error}") from error
    metadata = _Metadata(reader, gguf_path)
    hf_config = gguf_hf_config(metadata, {t.name for t in reader.tensors})
    tokenizer_json, tokenizer_config = gguf_tokenizer(metadata)

    staging = staging_dir_for(out_hf_dir)
    try:
        _write_weights(reader, hf_config, staging / "model.safetensors", gguf_path)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        (staging / "tokenizer.json").write_text(tokenizer_json)
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
        publish(staging, out_hf_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_hf_dir


class _Metadata:
    """Typed access to a GGUF's key/value fields; errors name the key and the file."""

    def __init__(self, reader, path: Path):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        if key not in self.fields:
            raise CheckpointError(f"{self.path} lacks the GGUF metadata key {key!r}")
        return self.fields[key].contents()


def gguf_hf_config(metadata: _Metadata, tensor_names: set[str]) -> dict:
    """A Hugging Face ``config.json`` dict for the GGUF's model."""
    arch = metadata.need("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{metadata.path}: GGUF architecture {arch!r} is not supported; import_gguf reads 'llama'"
        )
    if "rope_freqs.weight" in tensor_names or metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise CheckpointError(
            f"{metadata.path} uses RoPE frequency scaling (rope_freqs / rope.scaling), which "
            "import_gguf does not translate; convert the original Hugging Face model instead"
        )
    num_heads = int(metadata.need(f"{arch}.attention.head_count"))
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise CheckpointError(f"{metadata.path}: per-layer {arch}.attention.head_count_kv is not supported")
    hidden_size = int(metadata.need(f"{arch}.embedding_length"))
    head_dim = metadata.get(f"{arch}.attention.key_length") or metadata.get(f"{arch}.rope.dimension_count")
    tokens = metadata.need("tokenizer.ggml.tokens")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    eos_ids = [i for i in (eos, eot) if i is not None]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(metadata.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(metadata.need(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim or hidden_size // num_heads),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation (``[out, in]`` rows, per head).

    llama.cpp stores each head's rows as interleaved (re, im) pairs; Hugging Face's
    rotate_half layout has all the first elements of the pairs, then all the second.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    return None


def _write_weights(reader, hf_config: dict, out_file: Path, gguf_path: Path) -> None:
    """Streams every tensor, dequantised to float32, into one safetensors file.

    The header is computed from the shapes up front, so only one tensor is in memory at
    a time (``safetensors.numpy.save_file`` would need them all).
    """
    from gguf.quants import dequantize

    plan = []
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise CheckpointError(f"{gguf_path}: GGUF tensor {tensor.name!r} has no Hugging Face counterpart")
        # GGUF lists dimensions fastest-first; numpy/HF order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        plan.append((name, tensor, shape))
    plan.sort(key=lambda item: item[0])

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _, shape in plan:
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)

    with out_file.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for name, tensor, shape in plan:
            try:
                weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            except NotImplementedError as error:
                raise CheckpointError(
                    f"{gguf_path}: tensor {tensor.name!r} has quantisation {tensor.tensor_type.name}, "
                    f"which gguf cannot dequantise: {error}"
                ) from None
            weight = weight.reshape(shape)
            if name.endswith("self_attn.q_proj.weight"):
                weight = unpermute_rotary_rows(weight, hf_config["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight"):
                weight = unpermute_rotary_rows(weight, hf_config["num_key_value_heads"])
            handle.write(np.ascontiguousarray(weight, dtype="<f4").tobytes())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def gguf_tokenizer(metadata: _Metadata) -> tuple[str, dict]:
    """``(tokenizer.json text, tokenizer_config dict)`` for the GGUF's byte-level BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{metadata.path}: tokenizer.ggml.model={kind!r} is not supported; import_gguf builds "
            "byte-level BPE ('gpt2') tokenizers"
        )
    tokens = list(metadata.need("tokenizer.ggml.tokens"))
    token_types = list(metadata.get("tokenizer.ggml.token_type") or ())
    merges = [tuple(m.split(" ")) for m in metadata.need("tokenizer.ggml.merges")]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # stored as raw text; respell in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False, byte_fallback=False)
    )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _GPT2_SPLIT_PRES:
            warnings.warn(f"{metadata.path}: unknown tokenizer.ggml.pre={pre!r}; splitting text as GPT-2 does")
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()

    def token_of(key):
        index = metadata.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token_of("tokenizer.ggml.bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    eos = token_of("tokenizer.ggml.eos_token_id")
    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, vocab[bos]))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        specials.append((eos, vocab[eos]))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # Control tokens (type 3) stay whole and are special; user-defined ones (type 4) stay
    # whole but are ordinary text. A control token outside the byte alphabet is a llama.cpp
    # mislabel and is skipped, as transformers does.
    control = [t for t, kind in zip(tokens, token_types) if kind == 3 and set(t) <= alphabet]
    user = [t for t, kind in zip(tokens, token_types) if kind == 4 and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    if user:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "model_max_length": int(metadata.get("llama.context_length", 4096)),
    }
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer.to_str(), tokenizer_config
