"""The serving layer: the engine service on its own thread, the gRPC and OpenAI-compatible
HTTP front ends, data parallelism over replicas, metrics and ``shiftjax serve``."""
