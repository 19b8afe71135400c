"""shiftjax: Shift Parallelism in JAX.

This module stays light: subpackage imports run it first. ``shiftjax.LLM`` and
``shiftjax.SamplingParams`` (and ``StructuredOutputs``, ``SpeculativeConfig``) load the serving layer on first access.
"""

import importlib
import pathlib

# The repository keeps kernels/, layouts/, checkpoints/ and serving/ beside this folder, and
# pyproject.toml's package-dir installs them as shiftjax.kernels, ... From a checkout that is
# not installed (a GPU machine the tree was copied to, run with the root on sys.path), the
# root joins this package's search path so that the same names resolve to the same folders.
_checkout = pathlib.Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))

_LAZY = {
    "LLM": "shiftjax.serving.engine.llm",
    "SamplingParams": "shiftjax.serving.engine.sampling_params",
    "StructuredOutputs": "shiftjax.serving.engine.structured_outputs",
    "SpeculativeConfig": "shiftjax.serving.engine.speculative",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    # The package root re-exports the serving layer's offline API without importing it
    # eagerly (BUILD: shiftjax itself does not depend on serving).
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
