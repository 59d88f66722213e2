"""README.md's Python examples each run alone, in a fresh interpreter, as a reader pastes them.

A block whose first line is a comment saying it does not run alone (``# not standalone: ...``)
is skipped here and says where it is tested instead.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
STANDALONE = [b for b in BLOCKS if not b.startswith("# not standalone")]


def test_readme_has_its_examples():
  assert len(STANDALONE) >= 4
  assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("index", range(len(STANDALONE)))
def test_readme_block_runs_alone_in_a_fresh_interpreter(index, tmp_path):
  block = STANDALONE[index]
  proc = subprocess.run(
    [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, f"README python block {index}:\n{block}\n{proc.stderr[-3000:]}"
