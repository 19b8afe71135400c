"""What a shiftjax checkpoint directory holds, and the error every checkpoint step raises.

A checkpoint is a directory::

    config.json          the Hugging Face config, unchanged
    tokenizer.json ...   the tokenizer files that the source had (optional)
    params/              Orbax StandardCheckpointer of the canonical ``Params``
    shiftjax.json        written last: format version, dtype and tensor shapes

It is assembled in a temporary sibling directory and renamed into place, so a directory
with ``shiftjax.json`` is complete; anything else is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

FORMAT_NAME = "shiftjax-checkpoint"
FORMAT_VERSION = 1
MARKER_FILE = "shiftjax.json"
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
DTYPES = ("bfloat16", "float32")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file or tensor."""


def nest(flat: dict) -> dict:
    """``{"layers.wq": x, "embed": y}`` → ``{"layers": {"wq": x}, "embed": y}``.

    Orbax sees plain nested dicts, not ``Params``: the dataclass is type-checked at
    construction (jaxtyping), and neither numpy arrays nor ShapeDtypeStructs are Arrays.
    The key paths are the same as those of ``Params``.
    """
    nested: dict = {}
    for path, value in flat.items():
        head, _, tail = path.partition(".")
        if tail:
            nested.setdefault(head, {})[tail] = value
        else:
            nested[head] = value
    return nested


def unnest(nested: dict) -> dict:
    """The inverse of :func:`nest`."""
    flat = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def read_marker(path: Path) -> dict:
    """The ``shiftjax.json`` of a complete checkpoint, or a CheckpointError saying what lacks."""
    path = Path(path)
    hint = "convert a Hugging Face model with `shiftjax convert HF_DIR OUT_DIR`"
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; {hint}")
    marker = path / MARKER_FILE
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is not a complete shiftjax checkpoint: it has no {MARKER_FILE} "
            f"(an interrupted conversion, or not a checkpoint at all); {hint}"
        )
    try:
        info = json.loads(marker.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{marker} is not valid JSON ({error}); {hint}") from None
    if info.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{marker} does not describe a {FORMAT_NAME}; {hint}")
    if info.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {info.get('version')!r}, this shiftjax "
            f"reads version {FORMAT_VERSION}; convert the model again"
        )
    for name in (CONFIG_FILE, PARAMS_DIR):
        if not (path / name).exists():
            raise CheckpointError(f"{path} is not a complete shiftjax checkpoint: {name} is missing")
    return info


def is_complete_checkpoint(path: Path) -> bool:
    try:
        read_marker(path)
    except CheckpointError:
        return False
    return True


def staging_dir_for(out_dir: Path) -> Path:
    """A fresh temporary sibling of ``out_dir`` (same file system, so rename is atomic)."""
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def publish(staging: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Renames the finished ``staging`` directory to ``out_dir``."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        if not overwrite:
            raise CheckpointError(f"{out_dir} already exists; remove it or pass overwrite")
        trash = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        out_dir.rename(trash)
        staging.rename(out_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out_dir)
