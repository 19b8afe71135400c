"""The engine layer: everything that turns requests into steps on the devices and steps
back into tokens, with no knowledge of any front end (docs/architecture.md).

``Engine``, ``EngineConfig``, ``LLM`` and ``SamplingParams`` load on first access (their
modules import JAX), so that ``from shiftjax.serving.engine import Engine`` works as it did
when the engine was one module."""

import importlib

_LAZY = {"Engine": "core", "EngineConfig": "config", "StepFailed": "core", "LLM": "llm",
         "SamplingParams": "sampling_params"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"shiftjax.serving.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
