"""What a checkpointed run is: the configuration saved with its checkpoints, and the refusal to
resume it under another one.

Every checkpoint of ``demo lm --checkpoint-dir DIR`` carries the run's configuration (model,
k, batch, seed, learning rate, data, processes). A resume compares it with its own before it
restores anything: a different value of any of them would continue another run's window with
other micro-batches (or fail deep inside Orbax on another model), so it refuses, naming each
value both ways and the flags that resume the saved run. ``--steps`` may grow (the run goes
on); a run whose checkpoints are past its last micro-step refuses too.
"""

from __future__ import annotations

import platform

# The settings that change what a resumed run computes, in the order a refusal lists them.
KEYS = ("model", "k", "batch_size", "lr", "seed", "data", "processes")


def of(args, k: int, processes: int) -> dict:
  """The configuration of this run, as saved with its checkpoints (JSON-able).

  >>> import argparse
  >>> args = argparse.Namespace(size="quick", batch_size=8, lr=3e-3, seed=0, num_docs=1024)
  >>> sorted(of(args, 4, 1)) == sorted(KEYS)
  True
  """
  python = ".".join(platform.python_version_tuple()[:2])
  return {
    "model": args.size,
    "k": k,
    "batch_size": args.batch_size,
    "lr": args.lr,
    "seed": args.seed,
    # The documents are the running interpreter's standard library; how many, the model says.
    "data": f"the Python {python} standard library",
    "processes": processes,
  }


def _flag(key: str, value) -> str:
  """The command-line spelling (or, for what no flag sets, the words) that give `value`."""
  if key == "model":
    return {"quick": "--quick", "full": "no --quick (the full model)"}.get(value, f"--size {value}")
  if key == "data":
    return f"the data of {value}"
  if key == "processes":
    return f"{value} process{'es' if value != 1 else ''}"
  return f"--{key.replace('_', '-')} {value}"


def mismatch(saved: dict, config: dict, directory: str) -> str | None:
  """The refusal for resuming checkpoints written under `saved` with `config`, or None.

  Args:
    saved: the configuration restored from the checkpoints.
    config: this run's (`of`).
    directory: the checkpoint directory, named in the message.

  Returns:
    None when every setting of `KEYS` agrees; else one message naming, for each that differs,
    the saved value and this run's, and the flags that resume the saved run.

  >>> print(mismatch({"k": 4, "seed": 0}, {"k": 2, "seed": 0}, "ckpt"))
  ... # doctest: +NORMALIZE_WHITESPACE
  refusing to resume ckpt: its checkpoints were written with --k 4, this run has --k 2. Run
  again with --k 4 to resume it, or give another --checkpoint-dir to start a new run.
  """
  changed = [key for key in KEYS if key in config and saved.get(key) != config[key]]
  if not changed:
    return None
  both = "; ".join(
    f"{_flag(key, saved.get(key))}, this run has {_flag(key, config[key])}" for key in changed
  )
  wanted = ", ".join(_flag(key, saved.get(key)) for key in changed)
  return (
    f"refusing to resume {directory}: its checkpoints were written with {both}. Run again "
    f"with {wanted} to resume it, or give another --checkpoint-dir to start a new run."
  )


def past_the_end(start: int, total: int, k: int, directory: str) -> str | None:
  """The refusal for checkpoints past this run's last micro-step (fewer ``--steps``), or None.

  >>> past_the_end(8, 12, 4, "ckpt") is None
  True
  """
  if start <= total:
    return None
  return (
    f"refusing to resume {directory}: its latest checkpoint is at micro-step {start}, past "
    f"this run's last ({total} = --steps {total // k} x k {k}); its parameters cannot be "
    f"un-trained. Give --steps {-(-start // k)} or more to go on, or another --checkpoint-dir."
  )
