"""Tiny random Hugging Face checkpoints for tests (no tests in here).

Each helper builds a real ``transformers`` model, saves it with ``save_pretrained`` as
safetensors (optionally re-split into an index plus shards) and returns the directory and
the model, so a test can compare shiftjax against ``transformers`` on the same weights.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np

KINDS = ("llama", "qwen2", "qwen3", "tied")


def make_tiny_hf_checkpoint(
    tmp_dir,
    kind: str = "llama",
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 128,
    seed: int = 0,
    num_shards: int = 1,
    with_tokenizer: bool = False,
):
    """Saves a tiny random float32 model to ``tmp_dir`` and returns ``(dir, hf_model)``.

    kind: ``"llama"`` (Llama 3 RoPE scaling, untied lm_head), ``"qwen2"`` (QKV bias, untied),
    ``"qwen3"`` (q/k norms, a head_dim that is not hidden_size / heads, tied as the small
    Qwen3 models are) or ``"tied"`` (Llama with the lm_head tied to the embedding). ``num_shards > 1`` writes
    ``model.safetensors.index.json`` and that many shards instead of one file.
    ``with_tokenizer`` adds a tiny word-level ``tokenizer.json`` and a
    ``tokenizer_config.json`` with a chat template.
    """
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "qwen2":
        config = transformers.Qwen2Config(
            **common, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False
        )
        config.architectures = ["Qwen2ForCausalLM"]
        model_class = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            **common, head_dim=hidden_size // num_heads + 8, rope_theta=1000000.0, tie_word_embeddings=True,
            use_sliding_window=False)
        config.architectures = ["Qwen3ForCausalLM"]
        model_class = transformers.Qwen3ForCausalLM
    else:
        rope = dict(rope_theta=10000.0)
        if kind == "llama":
            rope = dict(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            )
        config = transformers.LlamaConfig(**common, **rope, tie_word_embeddings=kind == "tied")
        config.architectures = ["LlamaForCausalLM"]
        model_class = transformers.LlamaForCausalLM

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    # Random init leaves norms at exactly 1 and biases at 0; perturb them so that a
    # swapped or dropped tensor shows up in a comparison.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(out)
    if num_shards > 1:
        reshard(out, num_shards)
    if with_tokenizer:
        write_tiny_tokenizer(out, vocab_size)
    return out, model


def reshard(hf_dir, num_shards: int) -> None:
    """Splits ``model.safetensors`` into ``num_shards`` files plus an index, as HF does."""
    from safetensors.numpy import load_file, save_file

    hf_dir = Path(hf_dir)
    single = hf_dir / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    groups = [names[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    total = 0
    for index, group in enumerate(groups, start=1):
        file_name = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, hf_dir / file_name, metadata={"format": "pt"})
        for n in group:
            weight_map[n] = file_name
            total += tensors[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    single.unlink()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<{{ message['role'] }}> {{ message['content'] }} {{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_tiny_tokenizer(hf_dir, vocab_size: int) -> None:
    """A word-level tokenizer over ``w3 … w{vocab_size-1}`` with ``<unk> <s> </s>`` first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    hf_dir = Path(hf_dir)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_state_dict_numpy(model) -> dict[str, np.ndarray]:
    """The model's tensors as float32 numpy arrays, keyed by Hugging Face name."""
    return {name: t.detach().cpu().float().numpy() for name, t in model.state_dict().items()}


@functools.lru_cache(maxsize=1)
def load_hf_smollm2_gguf():
    """``(model, tokenizer)``: transformers' own reading of the default model's GGUF file
    (float32), loaded once per test process and shared by every test module that asks.

    Also pins torch to one thread: with two, torch's CPU forward of this model took 3.7 s
    instead of 0.22 s on the 2-core test machine (threads fighting XLA's and each other).
    """
    import torch
    import transformers

    from shiftjax.checkpoints.default_model import default_gguf_path

    torch.set_num_threads(1)
    directory = Path(tempfile.mkdtemp(prefix="smollm2-gguf-"))
    (directory / "model.gguf").symlink_to(default_gguf_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file="model.gguf", dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file="model.gguf")
    return model.eval(), tokenizer
