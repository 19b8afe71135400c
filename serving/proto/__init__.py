"""The gRPC API's .proto files and the Python code generated from them (checked in).

The generated code sits beside its .proto under ``shiftjax/v1/`` and imports itself as
``shiftjax.serving.proto.shiftjax.v1``: ``regenerate.py`` runs protoc with the include
root placed so, because protoc writes imports from the .proto's path and a plain
``from shiftjax.v1 import ...`` would resolve inside our own top-level ``shiftjax``.
"""
