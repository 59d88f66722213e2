"""The demos: ``python -m optax_accum.demo [TASK]`` (after ``pip install -e ".[examples]"``).

Three tasks, each a module of this package; nothing in the library imports them:

* ``python -m optax_accum.demo`` (`digits`, the default): a small MLP on scikit-learn's
  handwritten digits trained three ways on the same batches (one large batch, `accumulate`,
  `microbatch`), compared to float32 rounding;
* ``python -m optax_accum.demo lm [--quick]`` (`lm`): a byte-level transformer on the standard
  library's source, token-weighted, under a memory budget; ``--checkpoint-dir`` trains it
  checkpointed and resumable;
* ``python -m optax_accum.demo dp [--quick]`` (`dp`): the digits with differential privacy
  (Poisson batches far larger than the micro-batch), ε and δ reported.

The optional dependencies (the ``examples`` extra: flax, scikit-learn, tqdm, matplotlib, grain,
orbax-checkpoint, dp-accounting) are imported where they are used, so importing these modules
never needs them.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Sequence

COMMAND = "python -m optax_accum.demo"

# The optional dependencies of the demos: module -> the package that provides it.
_EXTRAS = {
  "flax": "flax",
  "sklearn": "scikit-learn",
  "grain": "grain",
  "tqdm": "tqdm",
  "matplotlib": "matplotlib",
  "dp_accounting": "dp-accounting",
  "orbax": "orbax-checkpoint",
}

# The tasks other than the default (digits): the first argument names one; its module's
# `main(argv)` runs it.
TASKS = {
  "lm": ("optax_accum.demo.lm.cli", "a byte-level transformer, token-weighted, checkpointed"),
  "dp": ("optax_accum.demo.dp", "private training on the digits, one noise draw per update"),
}


def require(module: str, command: str = COMMAND):
  """Imports an optional dependency of the demos, or says how to install it.

  Args:
    module: the module to import (e.g. ``"flax.linen"``).
    command: the command that needs it, named in the error.

  Returns:
    The imported module.

  Raises:
    ImportError: naming the package and the install command, if it is not installed.

  >>> require("json").dumps([1])
  '[1]'
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    package = _EXTRAS.get(module.split(".")[0], module.split(".")[0])
    how = "pip install 'optax-accum[examples]'"
    raise ImportError(
      f"`{command}` needs {package!r}, which is not installed. Install it:\n\n    {how}\n\n"
      "(or, from a clone of the repository: pip install -e '.[examples]')."
    ) from e


def number(kind: type, test, needs: str):
  """An argparse `type`: parses `kind`, then checks it (``argument --x: must be ..., got ...``).

  Args:
    kind: the type to parse (`int`, `float`).
    test: the check the parsed value must pass.
    needs: what the value must be, said in the error.

  Returns:
    The `type=` function for `argparse.ArgumentParser.add_argument`.

  >>> p = argparse.ArgumentParser(prog="demo", exit_on_error=False)
  >>> _ = p.add_argument("--clip", type=POSITIVE)
  >>> p.parse_args(["--clip", "inf"])
  Traceback (most recent call last):
  argparse.ArgumentError: argument --clip: must be a positive finite number, got 'inf'
  """

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {needs}, got {text!r}") from None
    if not test(value):
      raise argparse.ArgumentTypeError(f"must be {needs}, got {text!r}")
    return value

  parse.__name__ = needs
  return parse


POSITIVE_INT = number(int, lambda v: v >= 1, "a positive int")
NON_NEGATIVE_INT = number(int, lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")
POSITIVE = number(float, lambda v: math.isfinite(v) and v > 0, "a positive finite number")


class Phases:
  """A progress bar over a task's phases, naming the one running (``compiling TrainStep …``).

  Every phase of a demo that can take more than a couple of seconds (model set-up, compiling,
  planning) shows on it, so no stretch of the run is silent. Hidden with ``progress=False``.

  Args:
    total: the number of phases.
    desc: the bar's label.
    progress: whether to show it.

  >>> import pytest
  >>> _ = pytest.importorskip("tqdm")  # the examples extra's (the wheel alone lacks it)
  >>> phases = Phases(2, "setup", progress=False)
  >>> phases("the model"); phases("compiling"); phases.close()
  """

  def __init__(self, total: int, desc: str, progress: bool = True):
    tqdm = require("tqdm").tqdm
    fmt = "{desc}: {n_fmt}/{total_fmt} {postfix} [{elapsed}]"
    self._bar = tqdm(total=total, desc=desc, disable=not progress, leave=True, bar_format=fmt)
    self._running = False

  def __call__(self, what: str) -> None:
    """Ends the running phase (if any) and starts `what`."""
    if self._running:
      self._bar.update(1)
    self._running = True
    self._bar.set_postfix_str(f"{what} …", refresh=True)

  def close(self) -> None:
    """Ends the last phase."""
    if self._running:
      self._bar.update(1)
    self._bar.set_postfix_str("done", refresh=True)
    self._bar.close()


def main(argv: Sequence[str] | None = None):
  """Runs the task the first argument names (`TASKS`), or the digits job; returns its results.

  Args:
    argv: the command line after ``python -m optax_accum.demo`` (default: `sys.argv`).

  Returns:
    What the task's ``main`` returns (the digits job: its three `digits.Result`).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] and argv[0] in TASKS:
    return importlib.import_module(TASKS[argv[0]][0]).main(argv[1:])
  from optax_accum.demo import digits  # noqa: PLC0415

  return digits.main(argv)
