"""Checkpoints: HF safetensors → Orbax conversion, GGUF import, sharded restore, tokenizer.

Importing this package is cheap; each name below loads its module on first access.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "shiftjax.checkpoints.format",
    "convert_hf_checkpoint": "shiftjax.checkpoints.convert",
    "load_checkpoint": "shiftjax.checkpoints.load",
    "load_config": "shiftjax.checkpoints.load",
    "load_tokenizer": "shiftjax.checkpoints.load",
    "Tokenizer": "shiftjax.checkpoints.tokenizer",
    "import_gguf": "shiftjax.checkpoints.gguf_import",
    "default_model_path": "shiftjax.checkpoints.default_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
