"""Finding and checking the safetensors files of a Hugging Face model directory.

Only headers are read here (a few kilobytes per file). Each header is checked against
the file's size, so a truncated download fails before any tensor is read, with the file
and the first tensor that is cut off named. A sharded model's index must agree with
the shards' headers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

from shiftjax.checkpoints.format import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes the converter can read, with the numpy dtype name they become.
READABLE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str  # safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file, checked against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is truncated: {size} bytes, not even a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path} is truncated or not a safetensors file: its header claims "
                    f"{header_len} bytes but the file has {size}"
                )
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        try:
            start, end = info["data_offsets"]
            info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the header entry of tensor {name!r} is malformed") from None
        if end > data_bytes or start > end:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} needs bytes {start}..{end} of the data "
                f"section, which has {data_bytes}; download the file again"
            )
    return header


def list_tensors(hf_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of the model in ``hf_dir``, from the index (sharded) or the single file."""
    hf_dir = Path(hf_dir)
    index_path = hf_dir / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path} is not a valid index: it needs a 'weight_map' object") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if len(files) > 1 and "model.safetensors" in files:
            # e.g. Mistral repositories also ship consolidated.safetensors (mistral-inference's
            # names); transformers reads model.safetensors.
            files = ["model.safetensors"]
        if not files:
            raise CheckpointError(f"{hf_dir} has no *.safetensors file and no {INDEX_FILE}")
        if len(files) > 1:
            raise CheckpointError(
                f"{hf_dir} has several safetensors files ({', '.join(files)}) but no {INDEX_FILE} "
                "saying which tensor is in which"
            )
        weight_map = None

    entries: dict[str, TensorEntry] = {}
    for file_name in files:
        path = hf_dir / file_name
        if not path.is_file():
            raise CheckpointError(f"{index_path} names the shard {file_name}, which does not exist")
        for name, info in read_header(path).items():
            if weight_map is not None and weight_map.get(name) != file_name:
                where = weight_map.get(name)
                raise CheckpointError(
                    f"index mismatch: tensor {name!r} is in {file_name} but {INDEX_FILE} "
                    + (f"puts it in {where}" if where else "does not list it")
                )
            if name in entries:
                raise CheckpointError(f"tensor {name!r} appears in both {entries[name].file.name} and {file_name}")
            entries[name] = TensorEntry(name, path, info["dtype"], tuple(info["shape"]))
    if weight_map is not None:
        for name, file_name in weight_map.items():
            if name not in entries:
                raise CheckpointError(
                    f"index mismatch: {INDEX_FILE} puts tensor {name!r} in {file_name}, "
                    "which does not contain it"
                )
    return entries
