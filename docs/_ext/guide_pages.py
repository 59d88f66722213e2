"""Sphinx extension for the guide pages: how a page's code runs, and figures from its output.

* Every guide whose code is executed (``{code-cell}`` blocks) gets, under its title, a note
  that its cells are one script, run top to bottom, each continuing the ones above it
  (`tests/test_guides_run.py` runs each page so). A page whose code calls an optimizer's
  ``update`` (in cells or plain ``python`` blocks) is told to call it under ``jax.jit``:
  un-jitted, each call traces and compiles its program again. The note is inserted when the
  page is read (`page_note` says what it holds), so that a new page gets it without anyone
  remembering to write it.
* The role ``{output}`` marks a figure that a sentence quotes from the page's executed output,
  e.g. ``the loss reaches {output}`1.816```. It renders as the plain text; the test checks that
  each such figure appears in the output of the cells above the sentence.
* The test runs each page and records it here (`record_executed`) in the build's cache of
  executed pages (`EXECUTED`, myst-nb's ``nb_execution_cache_path``): a build that keeps the
  cache (``.ci/docs --executed-by-tests``) renders those runs and runs only pages not in it.
"""

from __future__ import annotations

import fcntl
import pathlib
import re
from typing import Any

import nbformat
from docutils import nodes
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from sphinx.application import Sphinx

CODE_CELL = re.compile(r"^```\{code-cell\}", re.M)
# A call of an optimizer's `update` in a code cell: `tx.update(`, `update(` of a jitted one.
UPDATE_CALL = re.compile(r"(?<![\w.])(?:\w+\.)?update\(|\w+_update\(")
TITLE = re.compile(r"^# .*$", re.M)
# The docs build's cache of executed pages (jupyter-cache, keyed by a page's code cells).
EXECUTED = pathlib.Path(__file__).resolve().parent.parent / "_build" / ".jupyter_cache"

ONE_SCRIPT = (
  "The code on this page is one script: its cells run top to bottom in one Python process, "
  "each continuing the ones above it (a cell alone may need names defined earlier). Copy "
  "them in order."
)
JIT = (
  "Call `update` inside `jax.jit` (your jitted training step, or `jax.jit(tx.update)`), as "
  "the cells do. Called eagerly, every call traces and compiles its program again: correct, "
  "but hundreds of times slower or more, and nothing warns you."
)


def code_cells(source: str) -> list[str]:
  """The code of each ``{code-cell}`` block of a MyST page, in order (option lines dropped)."""
  cells = re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```\s*$", source, re.S | re.M)
  return ["".join(line for line in c.splitlines(True) if not line.startswith(":")) for c in cells]


def page_note(source: str) -> str | None:
  """The note put under a guide's title, or None for a page that needs none.

  A page with code cells is one script; a page whose code (cells or plain ``python`` blocks)
  calls an ``update`` is told to jit it.
  """
  code = code_cells(source) + re.findall(r"^```python\n(.*?)^```", source, re.S | re.M)
  parts = [ONE_SCRIPT] if CODE_CELL.search(source) else []
  if any(UPDATE_CALL.search(block) for block in code):
    parts.append(JIT)
  return f":::{{note}}\n{' '.join(parts)}\n:::\n" if parts else None


def insert_note(app: Sphinx, docname: str, source: list[str]) -> None:
  if not docname.startswith("guides/"):
    return
  note = page_note(source[0])
  title = TITLE.search(source[0])
  if note is None or title is None:
    return
  end = title.end()
  source[0] = f"{source[0][:end]}\n\n{note}{source[0][end:]}"


def output_role(name, rawtext, text, lineno, inliner, options=None, content=None):
  """``{output}`figure```: a figure quoted from the page's executed output, as plain text."""
  return [nodes.Text(text)], []


def record_executed(notebook: nbformat.NotebookNode, path: str) -> None:
  """Adds a page's executed notebook to `EXECUTED`, as the build itself would after running it.

  Test processes run pages side by side (pytest-xdist): one writes the cache at a time.
  """
  EXECUTED.mkdir(parents=True, exist_ok=True)
  with open(EXECUTED.parent / ".jupyter_cache.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    bundle = CacheBundleIn(notebook, path, data={"executed_by": "tests/test_guides_run.py"})
    get_cache(str(EXECUTED)).cache_notebook_bundle(bundle, check_validity=False, overwrite=True)


def setup(app: Sphinx) -> dict[str, Any]:
  app.connect("source-read", insert_note)
  app.add_role("output", output_role)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
