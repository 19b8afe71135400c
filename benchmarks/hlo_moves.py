"""Which weights and cache buffers a compiled step copies or slices, read off its optimised HLO.

A ``copy``, ``slice`` or ``dynamic-slice`` counts as touching a weight when either

- its result has a weight's shape: the stacked shape, or its trailing dimensions with any
  number of leading 1s (the ``lax.scan`` over layers slices ``[L, 1, K, N]`` to
  ``[1, 1, K, N]``, which the first version of this report missed), global or per-device;
- or its operand has a stacked weight's shape (the instruction reads from the stack).

The same for the KV cache. Whether a matched ``slice`` costs anything depends on where it
sits: inside the fusion of a GEMM operand XLA may read it in place (the unrolled layers on
the H200), a ``dynamic-slice`` out of the layer stack was a copy there (12.9 vs 5.7 ms a
Llama-3-8B step). The report gives the op, the shape and the enclosing computation, and
leaves that judgement to the timing beside it.
"""

from __future__ import annotations

import re
from collections import Counter

import jax

MOVES = ("copy", "dynamic-slice", "slice")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r"([\w.\-]+): [a-z0-9]+\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z0-9]+\[([0-9,]*)\]\S* ([a-z\-]+)\((.*)$")


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split(",") if d)


def leading_one_variants(shape: tuple[int, ...], keep: int) -> set[tuple[int, ...]]:
    """What one layer or block of a stack of ``shape`` looks like: every tail of ``shape``
    that keeps at least its last ``keep`` dims, with any of the tail's leading dims (not
    those ``keep``) set to 1. ``(L, 1, K, N)`` gives ``(1, 1, K, N)``, ``(1, K, N)``, ``(K, N)``..."""
    out = set()
    for start in range(len(shape) - keep + 1):
        tail = shape[start:]
        for ones in range(len(tail) - keep + 1):
            out.add((1,) * ones + tail[ones:])
    return out


def _stack_shapes(arrays) -> set[tuple[int, ...]]:
    """Global and per-device shapes of the arrays (the step body sees the per-device one)."""
    shapes = set()
    for a in arrays:
        shapes.add(tuple(a.shape))
        sharding = getattr(a, "sharding", None)
        if sharding is not None:
            shapes.add(tuple(sharding.shard_shape(a.shape)))
    return shapes


def find_moves(hlo: str, stack_shapes: set, slice_shapes: set) -> list[dict]:
    """Every copy / slice / dynamic-slice whose result is in ``slice_shapes`` or whose first
    operand has a shape in ``stack_shapes``."""
    found, names = [], {}
    computation = ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            names = {m.group(1): _shape(m.group(2)) for m in _PARAM.finditer(header.group(2))}
            continue
        inst = _INSTRUCTION.match(line)
        if not inst:
            continue
        name, dims, op, rest = inst.groups()
        shape = _shape(dims)
        names[name] = shape
        if op not in MOVES:
            continue
        operand = re.match(r"\s*%?([\w.\-]+)", rest)
        operand_shape = names.get(operand.group(1)) if operand else None
        if shape in slice_shapes or operand_shape in stack_shapes:
            found.append({"op": op, "shape": shape, "operand_shape": operand_shape, "computation": computation})
    return found


def summarize(moves: list[dict]) -> dict[str, int]:
    """Counts by 'op dtype-less shape <- operand shape'."""
    return dict(Counter(f"{m['op']} {list(m['shape'])} <- {list(m['operand_shape'] or [])}" for m in moves))


def hlo_report(compiled_or_text, caches, weights) -> dict:
    """The weight and cache moves of a compiled step, and its input-output aliases.

    ``weights``: ``ModelWeights`` (its TP and SP parameter trees) or any pytree of arrays;
    ``caches``: a ``KVCache`` (or a pytree of the cache arrays)."""
    hlo = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    trees = [weights.tp.layers, weights.sp.layers] if hasattr(weights, "tp") else [weights]
    matrices = [leaf for tree in trees for leaf in jax.tree.leaves(tree) if leaf.ndim >= 3]
    weight_stacks = _stack_shapes(matrices)
    weight_slices = set().union(*(leading_one_variants(s, 2) for s in weight_stacks)) if weight_stacks else set()
    cache_arrays = jax.tree.leaves(caches)
    cache_stacks = _stack_shapes(cache_arrays)
    # a cache slice keeps at least (pages, page_size, head_dim): one layer, or one slot of it
    cache_slices = set().union(*(leading_one_variants(s, 3) for s in cache_stacks))
    cache_moves = find_moves(hlo, cache_stacks, cache_slices)
    weight_moves = find_moves(hlo, weight_stacks, weight_slices)
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo)
    return {
        "weight_moves": summarize(weight_moves),
        "weight_dynamic_slices": sum(m["op"] == "dynamic-slice" for m in weight_moves),
        "weight_copies": sum(m["op"] == "copy" for m in weight_moves),
        "weight_static_slices": sum(m["op"] == "slice" for m in weight_moves),
        "cache_moves": summarize(cache_moves),
        "input_output_alias": alias.group(1) if alias else None,
    }
