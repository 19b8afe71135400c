"""Generated code for the ``shiftjax.v1`` protobuf package (do not edit; regenerate)."""
