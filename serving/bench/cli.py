"""``shiftjax bench serve|compare``: the load generator and the deployment comparison."""

from __future__ import annotations

import sys


def bench_main(argv: list[str]) -> int:
    commands = {"serve": "shiftjax.serving.bench.serve_bench:serve_main",
                "compare": "shiftjax.serving.bench.compare:compare_main"}
    if not argv or argv[0] not in commands:
        print("usage: shiftjax bench {serve,compare} ... (--help on either)", file=sys.stderr)
        return 2
    import importlib

    module, name = commands[argv[0]].split(":")
    return getattr(importlib.import_module(module), name)(argv[1:])
