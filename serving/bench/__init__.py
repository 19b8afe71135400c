"""The load generator and deployment comparison behind ``shiftjax bench`` (vLLM's metric definitions)."""
