"""What a kernel named in a profile computes: its fusion instruction and fused computation,
read off the optimized HLO that ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`` dumps.

A GPU profile names an XLA kernel after its fusion instruction with ``.`` written as ``_``
(``loop_convert_fusion_32`` is ``%loop_convert_fusion.32``). For every dumped module after
optimizations that has one of ``--kernels``, this prints the instruction (its shape and
operands) and the computation it calls, each cut to ``--lines`` lines.

    python3 benchmarks/hlo_fusions.py DIR --kernels loop_convert_fusion_32,wrapped_transpose
    python3 benchmarks/hlo_fusions.py DIR --anatomy anatomy_fp8.json --top 60   # its decode step's top kernels
    python benchmarks/hlo_fusions.py --smoke --out DIR   # the CPU: a small function's dump, read back

With ``--out``, the findings also go to ``DIR/hlo_fusions.json`` (module -> kernel -> text).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def instruction_pattern(kernel: str) -> re.Pattern:
    """The HLO instruction a profiled kernel name stands for (``_`` may be ``.`` or ``_``)."""
    name = "[._]".join(re.escape(part) for part in kernel.split("_"))
    return re.compile(rf"^\s*(?:ROOT )?%?({name}) = .*$", re.M)


def computation(text: str, name: str, lines: int) -> str:
    """The body of computation ``name`` in ``text``, cut to ``lines`` lines."""
    match = re.search(rf"^%?{re.escape(name)} \(.*\{{$", text, re.M)
    if match is None:
        return f"(computation {name} not found)"
    body = text[match.start():text.find("\n}", match.end()) + 2].splitlines()
    return "\n".join(body[:lines] + ([f"... {len(body) - lines} more lines"] if len(body) > lines else []))


def describe(text: str, kernels: list[str], lines: int) -> dict[str, str]:
    """kernel -> its instruction and called computation, for each of ``kernels`` in ``text``."""
    found = {}
    for kernel in kernels:
        match = instruction_pattern(kernel).search(text)
        if match is None:
            continue
        line = match.group(0).strip()
        called = _CALLS.search(line)
        found[kernel] = f"{line[:2000]}\n" + (computation(text, called.group(1), lines) if called else "")
    return found


def anatomy_kernels(path: Path, part: str, top: int) -> list[str]:
    """The ``top`` kernels by time of ``part`` (``decode`` or ``ttft``) of an anatomy
    file (``fp8_served_anatomy.py``), every device's."""
    devices = json.loads(path.read_text())[part]["devices"]
    return [name for device in devices.values() for name in list(device["top_kernels"])[:top]]


def smoke_dump(folder: Path) -> list[str]:
    """Dumps a small jitted function's HLO into ``folder`` on the CPU (``XLA_FLAGS`` set
    before JAX starts) and returns its fusions' names, as a profile would name their kernels."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={folder} --xla_dump_hlo_as_text"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)  # a cached executable dumps nothing
    jax.jit(lambda x: (jnp.cos(x) * x).astype(jnp.bfloat16).T + 1)(jnp.ones((64, 32))).block_until_ready()
    text = "".join(path.read_text() for path in folder.glob("*jit__lambda*after_optimizations.txt"))
    return sorted({name.replace(".", "_") for name in re.findall(r"%([\w.]*fusion[\w.]*) = ", text)})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, nargs="?", help="the --xla_dump_to folder")
    parser.add_argument("--kernels", default="", help="profiled kernel names, comma-separated")
    parser.add_argument("--anatomy", type=Path, help="and the top kernels of this served_anatomy.py result")
    parser.add_argument("--part", default="decode", choices=("decode", "ttft"))
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--module", default="", help="only modules whose file name contains this")
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--out", type=Path, help="also write the findings to OUT/hlo_fusions.json")
    parser.add_argument("--smoke", action="store_true", help="the CPU: dump a small function and read it back")
    args = parser.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    if args.smoke:
        args.dump = Path(tempfile.mkdtemp())
        kernels += smoke_dump(args.dump)
    elif args.dump is None:
        parser.error("the dump folder is required (or --smoke)")
    if args.anatomy:
        kernels += anatomy_kernels(args.anatomy, args.part, args.top)
    findings = {}
    for path in sorted(args.dump.glob("*after_optimizations.txt")):
        if args.module not in path.name:
            continue
        found = describe(path.read_text(), kernels, args.lines)
        if found:
            findings[path.name] = found
            print(f"# {path.name}\n" + "\n".join(f"## {kernel}\n{text}" for kernel, text in found.items()) + "\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hlo_fusions.json").write_text(json.dumps(findings, indent=1))
    if args.smoke:
        shutil.rmtree(args.dump)


if __name__ == "__main__":
    main()
