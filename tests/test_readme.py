"""README.md's Python examples run, top to bottom, as one script (as a reader would paste them).

A block whose first line is a comment naming a file (``# train.py``) is a file to save, not a
step of the walk-through, and is not run here (the code it shows is tested elsewhere).
"""

import pathlib
import re

import pytest

pytestmark = pytest.mark.slow  # every README example, executed: a documentation test

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  return [b for b in blocks if not re.match(r"# [\w/]+\.py\n", b)]


def test_readme_examples_run_in_order(tmp_path, monkeypatch):
  blocks = _blocks()
  assert len(blocks) >= 10
  monkeypatch.chdir(tmp_path)  # examples that write files write them here
  namespace = {"__name__": "__readme__"}
  for i, block in enumerate(blocks):
    exec(compile(block, f"README.md[python block {i}]", "exec"), namespace)
