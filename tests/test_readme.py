"""README.md's complete examples run (a fragment that starts without an import is skipped)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = [
  b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if b.startswith("import")
]


def test_readme_has_runnable_examples():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
  exec(compile(BLOCKS[index], f"README.md[example {index}]", "exec"), {"__name__": "__readme__"})
