"""The language-model guide is a recipe: each of its Python blocks runs alone, in a fresh
interpreter, as a reader pastes it (and `examples/lm_resume.py`, which it shows whole, is run
by tests/test_lm_example.py)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "language_model.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_lm_guide_every_python_block_is_standalone():
  assert len(BLOCKS) == 4  # TrainStep with token weights, the planner, the noise scale, launch
  assert "```{literalinclude} ../../examples/lm_resume.py" in GUIDE.read_text()


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_lm_guide_block_runs_alone_in_a_fresh_interpreter(index, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # a reader's fresh shell
  proc = subprocess.run(
    [sys.executable, "-c", BLOCKS[index]],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert proc.returncode == 0, f"guide block {index}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
  assert proc.stdout.strip(), "each block prints what it shows"
