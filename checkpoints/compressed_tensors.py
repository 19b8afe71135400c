"""Reading FP8 checkpoints in the format Hugging Face hosts them: ``compressed-tensors``.

An FP8 Llama on the Hub (e.g. the ``-FP8`` and ``-FP8-dynamic`` Llama-3.1 checkpoints) says
``"quant_method": "compressed-tensors"`` in its ``config.json``'s ``quantization_config``
and stores each quantized linear layer as ``<layer>.weight`` in ``F8_E4M3`` (``[out, in]``)
with ``<layer>.weight_scale`` in float32 or bf16: one scale per output channel
(``[out, 1]``, strategy ``channel``) or one for the tensor (``[1]`` or ``[]``, strategy
``tensor``). ``<layer>.input_scale`` (static activation scales) is read past: shiftjax
quantizes activations per token in the step; so are a ``kv_cache_scheme``'s
``self_attn.k_scale`` / ``v_scale`` (``--kv-cache-dtype fp8`` runs at scales of 1.0).

The converter dequantizes ``values * scale`` into the canonical float32 or bf16 arrays and
records the quantization in ``shiftjax.json``, so the checkpoint is served FP8 by default.
Where each channel's scale is its absmax over 448 (the min-max observer llm-compressor
uses by default), the load's per-channel quantization gives back the checkpoint's e4m3
values (a dequantized weight is off by less than a bf16 rounding, far inside half an e4m3
step; tests/test_fp8_weights.py checks it in float32 and bf16). Other scales, and
per-tensor ones, become per-channel absmax scales: the values are quantized again, on a
grid as fine or finer.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

from shiftjax.checkpoints.format import CheckpointError
from shiftjax.checkpoints.safetensors_files import read_header

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
SCALE_SUFFIX = ".weight_scale"
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """What a compressed-tensors ``quantization_config`` says, as far as shiftjax reads it."""

    weight_strategy: str  # "channel" | "tensor"
    dynamic_activations: bool  # False: the checkpoint has static input scales (read past)

    def record(self) -> dict:
        """The ``quantization`` entry of ``shiftjax.json``."""
        return {"method": "fp8", "source": "compressed-tensors", "weight_strategy": self.weight_strategy,
                "dynamic_activations": self.dynamic_activations}


def fp8_scheme(hf_config: dict) -> Fp8Scheme | None:
    """The FP8 scheme of ``config.json``'s ``quantization_config``; None without one;
    CheckpointError for any quantization shiftjax cannot read, naming the field."""
    block = hf_config.get("quantization_config")
    if block is None:
        return None
    if not isinstance(block, dict):
        raise CheckpointError("config.json: quantization_config must be an object")
    method = block.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"config.json: quantization_config.quant_method={method!r} is not supported; "
                              f"shiftjax converts 'compressed-tensors' FP8 checkpoints (or quantizes a bf16 one "
                              f"with --quantization fp8)")
    groups = block.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("config.json: quantization_config.config_groups is missing or empty")
    strategies, dynamic = set(), True
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        where = f"quantization_config.config_groups.{name}.weights"
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise CheckpointError(f"config.json: {where} is {weights.get('num_bits')}-bit {weights.get('type')!r}; "
                                  f"shiftjax reads 8-bit float (FP8 e4m3) weights only")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise CheckpointError(f"config.json: {where}.strategy={strategy!r} is not supported; expected "
                                  f"'channel' or 'tensor'")
        strategies.add(strategy)
        activations = (group or {}).get("input_activations") or {}
        dynamic = dynamic and bool(activations.get("dynamic", True))
    return Fp8Scheme(weight_strategy="channel" if "channel" in strategies else "tensor", dynamic_activations=dynamic)


class RawTensors:
    """Tensors of one safetensors file read from their bytes (safetensors' numpy reader has
    no float8 types; F8_E4M3 becomes ml_dtypes' float8_e4m3fn). The tensor table is read
    and checked against the file's size (``read_header``) once, not once per tensor."""

    def __init__(self, file: Path):
        self.file = Path(file)
        with open(self.file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
        self.header, self.data_start = read_header(self.file), 8 + header_len

    def __call__(self, name: str) -> np.ndarray:
        import ml_dtypes

        dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16,
                  "F16": np.float16}
        info = self.header[name]
        if info["dtype"] not in dtypes:
            raise CheckpointError(f"tensor {name!r} in {self.file.name} has dtype {info['dtype']}, not one of "
                                  f"{sorted(dtypes)}")
        start, end = info["data_offsets"]
        with open(self.file, "rb") as handle:
            handle.seek(self.data_start + start)
            data = handle.read(end - start)
        dtype = np.dtype(dtypes[info["dtype"]])
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if len(data) != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} in {self.file.name}: {len(data)} bytes for shape {info['shape']}")
        return np.frombuffer(data, dtype).reshape(info["shape"])


def scale_name_of(weight_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``...q_proj.weight_scale``."""
    return weight_name + "_scale"


def check_scale_shape(weight_name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """A weight scale must be per output channel (``[out, 1]`` or ``[out]``) or per tensor
    (``[1]`` or ``[]``); anything else is refused naming both tensors."""
    out = weight_shape[0]
    if tuple(scale_shape) in ((out, 1), (out,), (1,), (), (1, 1)):
        return
    raise CheckpointError(f"tensor {scale_name_of(weight_name)!r} has shape {list(scale_shape)}, "
                          f"but the scale of {weight_name!r} (shape {list(weight_shape)}) must be per output "
                          f"channel ([{out}, 1]) or per tensor ([1])")


def dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``values * scale`` in float32, the scale broadcast per output channel or tensor."""
    scale = scale.astype(np.float32).reshape(-1, 1) if scale.size > 1 else scale.astype(np.float32).reshape(())
    return values.astype(np.float32) * scale
