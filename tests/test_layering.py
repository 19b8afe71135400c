"""The layering of docs/architecture.md, as declared in BUILD, holds for every import."""

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The folder each BUILD target's glob covers, and the package it imports as.
FOLDER_OF_TARGET = {
    "kernels": "kernels",
    "layouts": "layouts",
    "shiftjax": "shiftjax",
    "checkpoints": "checkpoints",
    "serving": "serving",
    "serving_engine": "serving/engine",
    "serving_server": "serving/server",
    "serving_client": "serving/client",
    "serving_bench": "serving/bench",
    "serving_proto": "serving/proto",
}
PACKAGE_OF_FOLDER = {
    "kernels": "shiftjax.kernels",
    "layouts": "shiftjax.layouts",
    "shiftjax": "shiftjax",
    "checkpoints": "shiftjax.checkpoints",
    "serving": "shiftjax.serving",
    "serving/engine": "shiftjax.serving.engine",
    "serving/server": "shiftjax.serving.server",
    "serving/client": "shiftjax.serving.client",
    "serving/bench": "shiftjax.serving.bench",
    "serving/proto": "shiftjax.serving.proto",
}
TARGET_OF_PACKAGE = {PACKAGE_OF_FOLDER[folder]: target for target, folder in FOLDER_OF_TARGET.items()}


def build_targets() -> dict[str, tuple[list[str], set[str]]]:
    """``name -> (srcs globs, deps)`` of every ``py_library`` in BUILD."""
    text = (ROOT / "BUILD").read_text()
    targets = {}
    for block in re.finditer(r"py_library\((.*?)\n\)", text, re.S):
        body = block.group(1)
        name = re.search(r'name = "(\w+)"', body).group(1)
        globs = re.findall(r'"([\w/*.]+\.py)"', re.search(r"srcs = glob\(\[(.*?)\]\)", body, re.S).group(1))
        targets[name] = (globs, set(re.findall(r'":(\w+)"', body)))
    return targets


def declared_deps() -> dict[str, set[str]]:
    return {name: deps for name, (_, deps) in build_targets().items()}


def target_of_module(module: str) -> str | None:
    """The BUILD target whose package holds ``module`` (the longest package prefix)."""
    best = None
    for package, target in TARGET_OF_PACKAGE.items():
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(best[0]):
                best = (package, target)
    return None if best is None else best[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_module(node.value):
            found.add(node.value)  # importlib.import_module("shiftjax.x") in lazy re-exports
    return found


def _names_a_module(text: str) -> bool:
    """A string that names a shiftjax module (a lazy re-export's target), not a logger's
    or a protobuf service's name that merely looks like one."""
    if not text.startswith("shiftjax.") or not text.replace(".", "").replace("_", "").isalnum():
        return False
    try:
        return importlib.util.find_spec(text) is not None
    except ModuleNotFoundError:
        return False


def test_build_declares_the_layer_table():
    assert declared_deps() == {
        "kernels": set(),
        "layouts": set(),
        "shiftjax": {"kernels", "layouts"},
        "checkpoints": {"shiftjax", "layouts"},
        "serving_proto": set(),
        "serving_engine": {"checkpoints", "kernels", "layouts", "shiftjax"},
        "serving_server": {"checkpoints", "serving_engine", "serving_proto"},
        "serving_client": {"serving_proto"},
        "serving_bench": {"checkpoints", "serving_client", "serving_engine", "serving_proto", "serving_server"},
        "serving": {"checkpoints", "serving_bench", "serving_client", "serving_engine", "serving_server", "shiftjax"},
    }


def test_the_forbidden_edges_are_not_declared():
    """What the layers exist for: the engine knows no front end, the server no benchmark, and
    the client no JAX (so that a client process needs neither)."""
    deps = declared_deps()

    def reaches(source: str, target: str) -> bool:
        seen, todo = set(), [source]
        while todo:
            name = todo.pop()
            if name == target:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(deps[name])
        return False

    for source, target in [("serving_engine", "serving_server"), ("serving_server", "serving_bench"),
                           ("serving_client", "serving_engine"), ("serving_client", "shiftjax"),
                           ("serving_engine", "serving_proto")]:
        assert not reaches(source, target), f"{source} may reach {target}"


def test_every_source_file_belongs_to_one_target():
    owners: dict[Path, list[str]] = {}
    for name, (globs, _) in build_targets().items():
        for pattern in globs:
            for path in ROOT.glob(pattern):
                owners.setdefault(path, []).append(name)
    for target, folder in FOLDER_OF_TARGET.items():
        for path in (ROOT / folder).rglob("*.py"):
            nearest = max((f for f in FOLDER_OF_TARGET.values() if path.is_relative_to(ROOT / f)), key=len)
            assert owners.get(path) == [target] or nearest != folder, (path, owners.get(path))


def test_every_import_is_declared_in_build():
    deps = declared_deps()
    # The package root's lazy attributes (shiftjax.LLM) point into serving on access only;
    # the executable store hashes every package's source files (a stored step is stale when
    # any of them changed) and runs none of their code.
    allowed_lazy = {"shiftjax/__init__.py", "serving/engine/executable_store.py"}
    violations = []
    for name, (globs, _) in build_targets().items():
        for pattern in globs:
            for path in sorted(ROOT.glob(pattern)):
                relative = str(path.relative_to(ROOT))
                for module in imported_modules(path):
                    if module.startswith(".."):
                        violations.append(f"{relative}: {module!r} leaves its folder")
                        continue
                    if module.startswith("."):  # within the same folder
                        continue
                    target = target_of_module(module)
                    if target is None or target == name or relative in allowed_lazy:
                        continue
                    if target not in deps[name]:
                        violations.append(f"{relative} imports {module} ({target}) undeclared")
    assert not violations, "\n".join(violations)
