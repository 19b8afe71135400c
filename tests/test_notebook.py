"""notebooks/quickstart.ipynb runs from top to bottom without an error (nbclient, a fresh
ipykernel) and draws its plot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from subprocess_env import environ_without_device_count

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The notebook makes its own 4 CPU devices through jax.config; the 8 that conftest.py
    # asks for through XLA_FLAGS would leak into the kernel's environment otherwise.
    env = environ_without_device_count()
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=env)  # raises CellExecutionError, naming the cell, on any error
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs), "the notebook drew no plot"
    text = "".join(output.get("text", "") for output in outputs)
    assert "TP " in text or "SP " in text, "the burst printed no step trace"
