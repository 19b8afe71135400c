"""Entry points for ``shiftjax convert`` and ``shiftjax import-gguf`` (wired in by serving/cli.py).

Each takes the argument list after the subcommand and returns a process exit status;
errors in the input print one sentence to stderr and return 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time


def convert_main(argv: list[str] | None = None) -> int:
    """``shiftjax convert HF_DIR OUT_DIR [--dtype bfloat16|float32] [--overwrite]``."""
    parser = argparse.ArgumentParser(
        prog="shiftjax convert",
        description="Convert a Hugging Face model directory (config.json, *.safetensors, tokenizer) "
        "into a shiftjax checkpoint.",
    )
    parser.add_argument("hf_dir", metavar="HF_DIR")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="stored dtype of the weights (default: bfloat16)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)

    from shiftjax.checkpoints.convert import convert_hf_checkpoint
    from shiftjax.checkpoints.format import CheckpointError

    start = time.perf_counter()
    try:
        out = convert_hf_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    except CheckpointError as error:
        print(f"shiftjax convert: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.dtype}) in {time.perf_counter() - start:.1f} s")
    return 0


def import_gguf_main(argv: list[str] | None = None) -> int:
    """``shiftjax import-gguf GGUF OUT_DIR [--convert [--dtype D]] [--overwrite]``.

    Without ``--convert`` OUT_DIR is a Hugging Face directory (float32 safetensors); with
    it, OUT_DIR is a shiftjax checkpoint and the intermediate directory is discarded.
    """
    parser = argparse.ArgumentParser(
        prog="shiftjax import-gguf",
        description="Import a llama.cpp GGUF file (dequantised to float32) as a Hugging Face "
        "model directory, or with --convert straight into a shiftjax checkpoint.",
    )
    parser.add_argument("gguf", metavar="GGUF")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--convert", action="store_true",
                        help="write a shiftjax checkpoint instead of a Hugging Face directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                        help="with --convert: stored dtype of the weights (default: float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)

    import tempfile
    from pathlib import Path

    from shiftjax.checkpoints.convert import convert_hf_checkpoint
    from shiftjax.checkpoints.format import CheckpointError
    from shiftjax.checkpoints.gguf_import import import_gguf

    start = time.perf_counter()
    out = Path(args.out_dir)
    try:
        if not args.convert:
            import_gguf(args.gguf, out, overwrite=args.overwrite)
        else:
            if out.exists() and not args.overwrite:
                raise CheckpointError(f"{out} already exists; remove it or pass --overwrite")
            out.absolute().parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".gguf-hf-", dir=out.absolute().parent) as work:
                hf_dir = import_gguf(args.gguf, Path(work) / "hf")
                convert_hf_checkpoint(hf_dir, out, dtype=args.dtype, overwrite=args.overwrite)
    except CheckpointError as error:
        print(f"shiftjax import-gguf: {error}", file=sys.stderr)
        return 2
    kind = f"shiftjax checkpoint ({args.dtype})" if args.convert else "Hugging Face directory"
    print(f"wrote {out} as a {kind} in {time.perf_counter() - start:.1f} s")
    return 0
