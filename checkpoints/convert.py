"""Hugging Face safetensors → shiftjax Orbax checkpoint.

Every tensor is planned from the headers first (names, shapes, dtypes, index), so a bad
checkpoint fails before any weight is read. Then the stacked canonical arrays are
allocated once, in the target dtype, and filled one Hugging Face tensor at a time
(``safe_open`` maps the file; only the tensor being copied is materialised), so host
memory holds the model once plus one tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np

from shiftjax.checkpoints.format import (
    CONFIG_FILE,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    nest,
    PARAMS_DIR,
    TOKENIZER_FILES,
    CheckpointError,
    publish,
    staging_dir_for,
)
from shiftjax.checkpoints import compressed_tensors as ct
from shiftjax.checkpoints.safetensors_files import READABLE_DTYPES, TensorEntry, list_tensors
from shiftjax.config import ConfigError, ModelConfig
from shiftjax.params import param_shapes

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
# Per-layer suffix → (canonical field, transpose to x @ w).
_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers that some exporters save and that carry nothing the config does not.
_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One Hugging Face tensor and where it lands in the canonical arrays."""

    entry: TensorEntry
    path: str  # canonical path, e.g. "layers.wq"
    layer: int | None
    transpose: bool
    scale: TensorEntry | None = None  # an FP8 weight's weight_scale (compressed-tensors)


def read_hf_config(hf_dir: Path) -> tuple[dict, ModelConfig]:
    """The raw ``config.json`` dict and the validated ModelConfig; errors name the file."""
    path = Path(hf_dir) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; a Hugging Face model directory needs it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    try:
        return raw, ModelConfig.from_hf_dict(raw)
    except ConfigError as error:
        raise CheckpointError(f"{path}: {error}") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path} has a field of the wrong type: {error}") from None


def plan_copies(config: ModelConfig, entries: dict[str, TensorEntry],
                fp8: ct.Fp8Scheme | None = None) -> list[_Copy]:
    """Matches every Hugging Face tensor to its canonical slot, checking names and shapes.
    ``fp8``: the checkpoint's compressed-tensors scheme; its F8_E4M3 weights then need a
    ``weight_scale`` of a per-channel or per-tensor shape (compressed_tensors.py)."""
    shapes = param_shapes(config)
    copies: list[_Copy] = []
    unexpected: list[str] = []
    for name, entry in entries.items():
        if _IGNORED_RE.search(name):
            continue
        if fp8 is not None and (name.endswith(ct.SCALE_SUFFIX) or name.endswith(ct.IGNORED_SUFFIXES)):
            continue  # read with the weight it scales (input scales: activations are quantized per token)
        layer = None
        if name in _GLOBAL_NAMES:
            path, transpose = _GLOBAL_NAMES[name]
        elif (match := _LAYER_RE.match(name)) and match.group(2) in _LAYER_NAMES:
            layer = int(match.group(1))
            field, transpose = _LAYER_NAMES[match.group(2)]
            path = f"layers.{field}"
            if layer >= config.num_layers:
                unexpected.append(name)
                continue
        else:
            unexpected.append(name)
            continue
        if path not in shapes:
            if path == "lm_head" and config.tie_word_embeddings:
                continue  # some exporters save the tied head anyway; the embedding is the truth
            unexpected.append(name)
            continue
        expected = shapes[path][1:] if layer is not None else shapes[path]
        if transpose:
            expected = expected[::-1]
        if entry.shape != tuple(expected):
            raise CheckpointError(
                f"tensor {name!r} in {entry.file.name} has shape {list(entry.shape)}, "
                f"but config.json implies {list(expected)}"
            )
        scale = None
        if entry.dtype == ct.FP8_DTYPE and transpose:
            scale = _fp8_scale(name, entry, entries, fp8)
        elif entry.dtype not in READABLE_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {entry.file.name} has dtype {entry.dtype}, which the "
                f"converter cannot read; expected one of {sorted(READABLE_DTYPES)}"
            )
        copies.append(_Copy(entry, path, layer, transpose, scale))
    if unexpected:
        shown = ", ".join(repr(n) for n in sorted(unexpected)[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(
            f"unexpected tensors {shown}{more}: config.json ({config.architecture}, "
            f"{config.num_layers} layers, qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, "
            f"tie_word_embeddings={config.tie_word_embeddings}) has no place for them"
        )
    have = {(c.path, c.layer) for c in copies}
    for path in shapes:
        layers = range(config.num_layers) if path.startswith("layers.") else [None]
        for layer in layers:
            if (path, layer) not in have:
                raise CheckpointError(f"tensor {_hf_name(path, layer)!r} is missing from the checkpoint")
    return copies


def _fp8_scale(name: str, entry: TensorEntry, entries: dict[str, TensorEntry],
               fp8: ct.Fp8Scheme | None) -> TensorEntry:
    """The ``weight_scale`` of the F8_E4M3 weight ``name``, checked."""
    if fp8 is None:
        raise CheckpointError(f"tensor {name!r} in {entry.file.name} is {ct.FP8_DTYPE}, but config.json has no "
                              f"quantization_config saying how it is quantized (compressed-tensors)")
    scale = entries.get(ct.scale_name_of(name))
    if scale is None:
        raise CheckpointError(f"tensor {name!r} is FP8 but its scale {ct.scale_name_of(name)!r} is missing "
                              f"from the checkpoint")
    if scale.dtype not in ct.SCALE_DTYPES:
        raise CheckpointError(f"tensor {scale.name!r} has dtype {scale.dtype}; a weight scale must be one of "
                              f"{list(ct.SCALE_DTYPES)}")
    ct.check_scale_shape(name, entry.shape, scale.shape)
    return scale


def _hf_name(path: str, layer: int | None) -> str:
    table = _GLOBAL_NAMES if layer is None else _LAYER_NAMES
    for hf_name, (target, _) in table.items():
        if (target if layer is None else f"layers.{target}") == path:
            return hf_name if layer is None else f"model.layers.{layer}.{hf_name}"
    return path


def fill_params(config: ModelConfig, copies: list[_Copy], dtype: str) -> dict[str, np.ndarray]:
    """Allocates the canonical arrays in ``dtype`` and copies every tensor into place."""
    from safetensors import safe_open

    np_dtype = np.dtype(_numpy_dtype(dtype))
    flat = {path: np.empty(shape, np_dtype) for path, shape in param_shapes(config).items()}
    by_file: dict[Path, list[_Copy]] = {}
    for copy in copies:
        by_file.setdefault(copy.entry.file, []).append(copy)
    raw: dict[Path, ct.RawTensors] = {}  # FP8 files' tables, read once each
    for file, file_copies in by_file.items():
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for copy in file_copies:
                    if copy.scale is not None:  # FP8: safetensors' numpy reader has no float8
                        values = raw.setdefault(file, ct.RawTensors(file))(copy.entry.name)
                        scale_file = copy.scale.file
                        scale = raw.setdefault(scale_file, ct.RawTensors(scale_file))(copy.scale.name)
                        tensor = ct.dequantized(values, scale)
                    else:
                        tensor = handle.get_tensor(copy.entry.name)
                    if copy.transpose:
                        tensor = tensor.T
                    target = flat[copy.path] if copy.layer is None else flat[copy.path][copy.layer]
                    target[...] = tensor  # casts, rounding to nearest even for bfloat16
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {file}: {error}") from error
    return flat


def _numpy_dtype(dtype: str):
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float32


def save_params(flat: dict[str, np.ndarray], params_dir: Path) -> None:
    """Writes the canonical tree so that ``StandardCheckpointer().restore`` reads it.

    Orbax's default numpy handler deep-copies every host array before writing (so an
    async save may return early): a second copy of the whole model. Measured here with
    430 MB of arrays: peak RSS +420 MB with StandardCheckpointer (also with
    save_concurrent_gb=1), +0 with this synchronous save without the copy. Nothing
    touches the arrays while it runs, so the copy buys nothing.
    """
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers

    import inspect

    # (orbax-checkpoint releases before the option have no copy to skip, the GPU image's among them)
    no_copy = ({"deepcopy_host_arrays": False}
               if "deepcopy_host_arrays" in inspect.signature(type_handlers.NumpyHandler).parameters else {})
    registry = type_handlers.create_type_handler_registry((np.ndarray, type_handlers.NumpyHandler(**no_copy)))
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
    try:
        checkpointer.save(Path(params_dir).absolute(), args=ocp.args.PyTreeSave(nest(flat)))
    finally:
        checkpointer.close()


def convert_hf_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    *,
    overwrite: bool = False,
) -> Path:
    """Converts the Hugging Face model in ``hf_dir`` into a shiftjax checkpoint at ``out_dir``.

    ``dtype`` ("bfloat16" or "float32") is the stored dtype of every weight. Nothing is
    written to ``out_dir`` until the checkpoint is complete; on any error the partial work
    is removed and a CheckpointError names the file or tensor at fault.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _numpy_dtype(dtype)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} is not a directory")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; remove it or pass overwrite")
    raw_config, config = read_hf_config(hf_dir)
    fp8 = ct.fp8_scheme(raw_config)
    copies = plan_copies(config, list_tensors(hf_dir), fp8)

    staging = staging_dir_for(out_dir)
    try:
        flat = fill_params(config, copies, dtype)
        save_params(flat, staging / PARAMS_DIR)
        del flat
        (staging / CONFIG_FILE).write_text(json.dumps(raw_config, indent=2))
        copy_tokenizer_files(hf_dir, staging)
        marker = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype,
            "source": str(hf_dir.absolute()),
            "tensors": {path: list(shape) for path, shape in param_shapes(config).items()},
        }
        if fp8 is not None:  # served FP8 unless asked otherwise (load.checkpoint_quantization)
            marker["quantization"] = fp8.record()
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        publish(staging, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def copy_tokenizer_files(hf_dir: Path, out_dir: Path) -> None:
    """Copies the tokenizer files that exist; a separate ``chat_template.jinja`` (as
    transformers 5 saves it) is also folded into ``tokenizer_config.json``."""
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
    template_file = hf_dir / "chat_template.jinja"
    config_file = out_dir / "tokenizer_config.json"
    if template_file.is_file():
        try:
            tokenizer_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{hf_dir / 'tokenizer_config.json'} is not valid JSON: {error}") from None
        if not tokenizer_config.get("chat_template"):
            tokenizer_config["chat_template"] = template_file.read_text()
            config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
