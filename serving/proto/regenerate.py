"""Regenerates the checked-in gRPC code from the .proto files: ``python -m
shiftjax.serving.proto.regenerate`` (``--check`` only compares, exit status 1 on a difference).

protoc names imports after the .proto's path below the include root. The .proto files are
copied under ``shiftjax/serving/proto/`` in a scratch root so the generated imports read
``from shiftjax.serving.proto.shiftjax.v1 import inference_pb2``, which resolves inside
this package. Needs grpcio-tools (a dev dependency) at the version pyproject.toml pins,
since another version writes different text.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # serving/proto
IMPORT_PREFIX = Path("shiftjax/serving/proto")  # where protoc must believe the files are
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("shiftjax/**/*.proto"))


def generate() -> dict[Path, str]:
    """Generated file (path relative to serving/proto) -> its text, from a fresh protoc run."""
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        source_root, out = Path(scratch) / "src", Path(scratch) / "out"
        out.mkdir()
        relative = []
        for proto in proto_files():
            rel = IMPORT_PREFIX / proto.relative_to(PROTO_ROOT)
            (source_root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proto, source_root / rel)
            relative.append(str(rel))
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        status = protoc.main(["grpc_tools.protoc", f"-I{source_root}", f"-I{well_known}",
                              f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
                              *relative])
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {relative}")
        generated = {}
        for path in sorted((out / IMPORT_PREFIX).rglob("*")):
            if path.name.endswith(GENERATED_SUFFIXES):
                generated[path.relative_to(out / IMPORT_PREFIX)] = path.read_text()
        return generated


def differences() -> list[str]:
    """Generated files whose checked-in copy is missing or differs."""
    return [str(rel) for rel, text in generate().items()
            if not (PROTO_ROOT / rel).is_file() or (PROTO_ROOT / rel).read_text() != text]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = differences()
        for rel in stale:
            print(f"stale generated file: serving/proto/{rel}", file=sys.stderr)
        return 1 if stale else 0
    for rel, text in generate().items():
        (PROTO_ROOT / rel).write_text(text)
        print(f"wrote serving/proto/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
