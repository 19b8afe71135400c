"""The gRPC clients and ``shiftjax client``. ``Client``, ``AsyncClient``, ``Completion`` and
``StructuredOutputs`` load on first access (``grpc_client.py``), so importing this package
imports no grpc."""

import importlib

_LAZY = {"Client", "AsyncClient", "Completion", "StructuredOutputs"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module("shiftjax.serving.client.grpc_client"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
