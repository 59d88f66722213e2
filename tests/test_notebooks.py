"""The notebooks execute without error (nbclient, kernel python3), as committed."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # a notebook kernel executing the tour: a documentation test

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
TOUR = NOTEBOOKS / "tour.ipynb"


def _builder():
  spec = importlib.util.spec_from_file_location("build_tour", NOTEBOOKS / "build_tour.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_notebooks_tour_is_committed_with_outputs_and_matches_its_builder():
  nb = nbformat.read(TOUR, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.outputs and c.execution_count for c in code), (
    "notebooks/tour.ipynb must be committed executed: run python notebooks/build_tour.py"
  )
  images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
  assert images >= 3
  built = _builder().build()
  assert [c.source for c in nb.cells] == [c.source for c in built.cells], (
    "notebooks/tour.ipynb is out of date with notebooks/build_tour.py: rerun the builder"
  )


def _errors(nb) -> list[str]:
  """Each error output of an executed notebook: the cell's first line, the exception."""
  return [
    f"cell {c.source.splitlines()[0] if c.source else ''!r}: {o.ename}: {o.evalue}"
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.output_type == "error"
  ]


def _execute(nb):
  """Runs every cell of `nb` in a fresh kernel, recording errors as outputs (not raising), so
  that one run reports every failing cell."""
  nb = copy.deepcopy(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  NotebookClient(
    nb,
    timeout=240,
    kernel_name="python3",
    allow_errors=True,
    resources={"metadata": {"path": str(NOTEBOOKS)}},
  ).execute()
  return nb


def test_notebooks_errors_finds_a_failing_cell():
  # Positive control for the check below: a cell that raises is reported, the rest run on.
  nb = nbformat.v4.new_notebook(
    cells=[
      nbformat.v4.new_code_cell("raise ValueError('boom')"),
      nbformat.v4.new_code_cell("print('after')"),
    ]
  )
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  executed = _execute(nb)
  assert _errors(executed) == ["cell \"raise ValueError('boom')\": ValueError: boom"]
  assert executed.cells[1].outputs[0]["text"] == "after\n"


def test_notebooks_tour_executes():
  nb = _execute(nbformat.read(TOUR, as_version=4))
  errors = _errors(nb)
  assert not errors, "notebooks/tour.ipynb: cells raised:\n" + "\n".join(errors)
  images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
  assert images >= 3
