"""Every guide page runs as the page says it runs, and its figures are those of its output.

* A page with ``{code-cell}`` blocks says, under its title, that they are one script run top to
  bottom (docs/_ext/guide_pages.py puts the note there). Here each such page's cells run in
  order in one fresh Python process, as a reader who copies them all runs them: a Jupyter
  kernel started for the page, the process the docs build runs them in. Its cells joined are a
  plain Python program (no IPython syntax, no name only IPython defines), so the kernel's run is
  the script's run.
* A figure a sentence quotes from that output is written ``{output}`figure``` and must appear,
  as written, in the output of the cells above the sentence.
* Each run is recorded in the docs build's cache (``guide_pages.EXECUTED``), which the build
  renders instead of running the page again: CI builds the docs after the tests
  (``.ci/docs --executed-by-tests``), so every page runs once.
* The plain ``python`` blocks of an executed page are not executed by the build: each is a whole
  program, run here alone (the multi-host ``train.py`` through `optax_accum.launch`).
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import sys
import tempfile

import pytest
from jupyter_client.manager import KernelManager
from myst_nb.core.read import read_myst_markdown_notebook
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDES = ROOT / "docs" / "guides"
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import guide_pages  # noqa: E402

PAGES = sorted(p.stem for p in GUIDES.glob("*.md") if "{code-cell}" in p.read_text())
OUTPUT = re.compile(r"\{output\}`([^`]+)`")


# Names an IPython kernel defines that a plain script does not: a cell that reads one runs in
# the kernel and fails as a script.
IPYTHON_ONLY = {"display", "get_ipython", "In", "Out", "_ih", "_oh", "_", "__", "___"}


def _ipython_only(cells: list[str]) -> list[str]:
  """What keeps the cells joined from being a plain Python program: IPython syntax (magics,
  shell escapes, top-level ``await``: a SyntaxError) or a read of a name only IPython defines."""
  try:
    script = "\n".join(cells)
    compile(script, "<page>", "exec")  # top-level await passes ast.parse, not this
    tree = ast.parse(script)
  except SyntaxError as e:
    return [f"not plain Python: {e}"]
  names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in IPYTHON_ONLY]
  bound = {n.id for n in names if not isinstance(n.ctx, ast.Load)}
  return sorted({n.id for n in names if isinstance(n.ctx, ast.Load) and n.id not in bound})


def _printed(cell) -> str:
  """What a cell printed (stdout) and its last expression's value, as a script shows them."""
  return "".join(
    out["text"] if out["output_type"] == "stream" else out["data"]["text/plain"] + "\n"
    for out in cell.outputs
    if out.get("name") == "stdout" or out["output_type"] == "execute_result"
  )


@functools.cache
def _run_page(name: str) -> tuple[list[str], str]:
  """Runs the page's cells in order in a fresh kernel (one process) and records the executed
  page in the docs build's cache; returns each cell's printed output and the page's source."""
  path = GUIDES / f"{name}.md"
  source = path.read_text()
  # The notebook the docs build reads from the page (myst-nb's reader, as it calls it): the
  # cache matches the build's notebook to this one by its code cells.
  nb = read_myst_markdown_notebook(source, add_source_map=True, path=str(path))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)  # a reader's fresh shell: a page that needs devices sets them
  with tempfile.TemporaryDirectory(prefix="optax_accum_guide_") as ipc:
    # IPC sockets, not TCP, as the docs build's kernels (docs/conf.py says why).
    kernel = nb.metadata.kernelspec.name
    km = KernelManager(kernel_name=kernel, transport="ipc", ip=os.path.join(ipc, "kernel"))
    # No timing in the cells' metadata: the cache keys a page by its cells, metadata included.
    where = {"metadata": {"path": str(GUIDES)}}
    client = NotebookClient(nb, km=km, timeout=900, record_timing=False, resources=where)
    try:
      client.execute(env=env)
    except CellExecutionError as e:
      pytest.fail(f"{name}.md, its cells run top to bottom:\n{str(e)[-4000:]}")
  guide_pages.record_executed(nb, str(path))
  return [_printed(cell) for cell in nb.cells if cell.cell_type == "code"], source


def test_code_cells_and_note_read_a_page():
  page = (
    "# Title\n\nText.\n\n```{code-cell} ipython3\n:tags: [hide-output]\nx = 1\n```\n\n"
    "More.\n\n```{code-cell} ipython3\nupdates, state = tx.update(g, state)\n```\n"
  )
  assert guide_pages.code_cells(page) == ["x = 1\n", "updates, state = tx.update(g, state)\n"]
  note = guide_pages.page_note(page)
  assert "one script" in note and "jax.jit" in note
  assert "jax.jit" not in guide_pages.page_note(page.replace("tx.update", "tx.init"))
  assert guide_pages.page_note("# Title\n\n```python\nx = 1\n```\n") is None
  recipe = guide_pages.page_note("# Title\n\n```python\nu, s = tx.update(g, s)\n```\n")
  assert "jax.jit" in recipe and "one script" not in recipe  # plain blocks each run alone
  source = [page]
  guide_pages.insert_note(None, "guides/page", source)
  assert source[0].startswith("# Title\n\n:::{note}\nThe code on this page is one script")


def test_ipython_only_finds_what_a_script_cannot_run():
  assert _ipython_only(["import jax\n", "for _ in range(2):\n  x = jax.numpy.ones(3)\nx\n"]) == []
  assert _ipython_only(["x = 1\n", "display(x)\n"]) == ["display"]
  assert _ipython_only(["x = 1\n", "_ + 1\n"]) == ["_"]
  assert _ipython_only(["%timeit x = 1\n"])[0].startswith("not plain Python")
  assert _ipython_only(["import asyncio\nawait asyncio.sleep(0)\n"])[0].startswith("not plain")


def test_every_executed_guide_is_a_plain_python_script():
  found = {}
  for name in PAGES:
    cells = guide_pages.code_cells((GUIDES / f"{name}.md").read_text())
    if problems := _ipython_only(cells):
      found[name] = problems
  assert found == {}, f"cells that run in a kernel but not as one script: {found}"


def test_every_executed_guide_gets_the_one_script_note():
  assert len(PAGES) >= 12
  for name in PAGES:
    assert "one script" in guide_pages.page_note((GUIDES / f"{name}.md").read_text()), name


def test_every_guide_that_calls_update_is_told_to_jit_it():
  told = {
    p.stem for p in GUIDES.glob("*.md") if "jax.jit" in (guide_pages.page_note(p.read_text()) or "")
  }
  assert {"migration", "batch_size", "checkpointing", "language_model", "token_weighting"} <= told


@pytest.mark.slow  # each page in a fresh process: the docs build's work, recorded for it
@pytest.mark.parametrize("name", PAGES)
def test_guide_runs_top_to_bottom_as_one_script_with_its_figures(name):
  outputs, source = _run_page(name)
  starts = [m.start() for m in re.finditer(r"^```\{code-cell\}", source, re.M)]
  assert len(outputs) == len(starts)
  for m in OUTPUT.finditer(source):
    above = sum(start < m.start() for start in starts)
    line = source.count("\n", 0, m.start()) + 1
    shown = "".join(outputs[:above])
    assert m.group(1) in shown, (
      f"{name}.md line {line} quotes {m.group(1)!r}, which the cells above it do not print:\n"
      f"{shown[-3000:]}"
    )


def _python_blocks(name: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", (GUIDES / f"{name}.md").read_text(), re.S | re.M)


def test_plain_python_blocks_of_executed_pages_are_known():
  # A plain block is not executed by the build: each must be run below (or become a cell).
  found = {name: len(_python_blocks(name)) for name in PAGES if _python_blocks(name)}
  assert found == {"multi_device": 1}, found


@pytest.mark.slow  # two processes
def test_multi_device_train_py_runs_alone_as_two_processes(tmp_path, monkeypatch):
  from optax_accum import launch

  (block,) = _python_blocks("multi_device")
  assert block.startswith("# train.py\n")
  (tmp_path / "train.py").write_text(block)
  monkeypatch.setenv("PYTHONPATH", str(ROOT))  # `launch` passes this environment on
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  command = [sys.executable, str(tmp_path / "train.py")]
  codes = launch.launch(command, 2, local_devices=2, timeout=600, log_dir=str(tmp_path))
  logs = [(tmp_path / f"process_{i}.log").read_text() for i in range(2)]
  assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
  # Each process prints its index, the update count (2) and the same parameters.
  printed = [log.strip().splitlines()[-1].split(" ", 2) for log in logs]
  assert [p[:2] for p in printed] == [["0", "2"], ["1", "2"]] and printed[0][2] == printed[1][2]


# Figures in the prose of these pages that are not the page's own output: constants of the
# method, of the code above them, or of a committed run quoted with its file. Any other
# decimal figure in their prose must be an {output} figure (or math, or code).
OWN_PAGES = {
  "bad_input": set(),
  "batch_size": {
    "0.95",  # the EMA decay (a constant of the estimator)
    # benchmarks/results/gain/results.md (the LM part of `gain_experiments.py`):
    "1.570",
    "1.536",
    "2.1",
    # benchmarks/results/cpu/noise/ and `noise_profile.py` (the table and the profile):
    "6.4",
    "7.5",
    "1.9",
    "2.3",
    "3.4",
    "5.1",
    "0.99",
    "1.05",
    "1.02",
    "1.26",
    "1.03",
    "1.08",
    "1.15",
    "1.16",
    "1.01",
    "1.17",
    "1.00",  # (2.3 is also GPT-3's section 2.3)
  },
  "checkpointing": set(),
  "equinox": set(),
  "flax": set(),
  "migration": {"0.2.8"},  # the optax release checked against
  "multi_device": set(),
  "optax_composition": set(),
  "planner": set(),
  # benchmarks/results/cpu/fsdp.md (the FSDP section's table, with its command):
  "sharding": {
    "56.0",
    "31.5",
    "7.0",
    "5.75",
    "9.75",
    "13.5",
    "5.63",
    "9.06",
    "13.13",
    "1.24",
    "0.81",
  },
  "token_weighting": set(),  # 7.6 and 4.3 are math, derived from two {output} counts
}


def _prose_decimals(source: str) -> list[str]:
  prose = re.sub(r"^```.*?^```", "", source, flags=re.S | re.M)  # code blocks
  prose = re.sub(r"\{output\}`[^`]*`|`[^`]*`|\$\$.*?\$\$|\$[^$\n]*\$", "", prose, flags=re.S)
  prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets (arXiv numbers)
  return re.findall(r"(?<![\w.])\d+\.\d+(?:\.\d+)?(?![\w.]*\d)", prose)


def test_prose_decimals_finds_figures_outside_code_and_math():
  page = "It ends at 1.816 (`1.5` in code, $0.5$ in math, {output}`1.541`, [x](1812.06162))."
  assert _prose_decimals(page) == ["1.816"]


@pytest.mark.parametrize("name", sorted(OWN_PAGES))
def test_guide_prose_states_no_unchecked_figure(name):
  found = set(_prose_decimals((GUIDES / f"{name}.md").read_text()))
  assert found <= OWN_PAGES[name], (
    f"{name}.md states {sorted(found - OWN_PAGES[name])} in its prose: write a figure of the "
    "page's output as {output}`figure` (checked against it), or list a constant here"
  )
