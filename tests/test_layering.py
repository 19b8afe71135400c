"""The layering of DESIGN.md's folder table, as declared in BUILD, holds for every import."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER_OF_PACKAGE = {
    "shiftjax": "shiftjax",
    "shiftjax.kernels": "kernels",
    "shiftjax.layouts": "layouts",
    "shiftjax.serving": "serving",
    "shiftjax.checkpoints": "checkpoints",
}


def declared_deps() -> dict[str, set[str]]:
    text = (ROOT / "BUILD").read_text()
    deps = {}
    for block in re.finditer(r"py_library\((.*?)\n\)", text, re.S):
        name = re.search(r'name = "(\w+)"', block.group(1)).group(1)
        deps[name] = set(re.findall(r'":(\w+)"', block.group(1)))
    return deps


def folder_of_module(module: str) -> str | None:
    best = None
    for package, folder in FOLDER_OF_PACKAGE.items():
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(best[0]):
                best = (package, folder)
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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("shiftjax."):
            found.add(node.value)  # importlib.import_module("shiftjax.x") in lazy re-exports
    return found


def test_build_declares_the_design_table():
    deps = declared_deps()
    assert deps == {
        "kernels": set(),
        "layouts": set(),
        "shiftjax": {"kernels", "layouts"},
        "checkpoints": {"shiftjax", "layouts"},
        "serving": {"checkpoints", "kernels", "layouts", "shiftjax"},
    }


def test_every_import_is_declared_in_build():
    deps = declared_deps()
    # The package root's lazy attributes (shiftjax.LLM) point into serving on access only.
    allowed_lazy = {("shiftjax", "shiftjax/__init__.py")}
    violations = []
    for folder in deps:
        for path in sorted((ROOT / folder).rglob("*.py")):  # subpackages (serving/bench) too
            for module in imported_modules(path):
                if module.startswith(".."):
                    violations.append(f"{path.relative_to(ROOT)}: {module!r} leaves its folder")
                    continue
                if module.startswith("."):  # within the same folder
                    continue
                target = folder_of_module(module)
                if target is None or target == folder:
                    continue
                if (folder, str(path.relative_to(ROOT))) in allowed_lazy:
                    continue
                if target not in deps[folder]:
                    violations.append(f"{path.relative_to(ROOT)} imports {module} ({target}) undeclared")
    assert not violations, "\n".join(violations)
