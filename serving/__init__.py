"""The engine, its service and the front ends. ``shiftjax.serving.Client`` and
``AsyncClient`` (the gRPC clients) load on first access, so importing this package
imports neither JAX nor grpc."""

import importlib

_LAZY = {"Client": "shiftjax.serving.client.grpc_client", "AsyncClient": "shiftjax.serving.client.grpc_client"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
