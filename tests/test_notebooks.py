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


def test_notebooks_tour_executes():
  nb = copy.deepcopy(nbformat.read(TOUR, as_version=4))
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  client = NotebookClient(
    nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
  )
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
  ]
  assert not errors
  images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
  assert images >= 3
