"""``shiftjax bench serve|compare|merge|plot``: the load generator, the deployment
comparison, several comparisons merged into one report, and its plots redrawn."""

from __future__ import annotations

import sys


def bench_main(argv: list[str]) -> int:
    commands = {"serve": "shiftjax.serving.bench.serve_bench:serve_main",
                "compare": "shiftjax.serving.bench.compare:compare_main",
                "merge": "shiftjax.serving.bench.compare:merge_main",
                "plot": "shiftjax.serving.bench.compare_plots:plot_main"}
    if not argv or argv[0] not in commands:
        print("usage: shiftjax bench {serve,compare,merge,plot} ... (--help on either)", file=sys.stderr)
        return 2
    import importlib

    module, name = commands[argv[0]].split(":")
    return getattr(importlib.import_module(module), name)(argv[1:])
