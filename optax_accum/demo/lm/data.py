"""The language model's data: the standard library's source, as padded byte sequences, via grain.

A *document* is one paragraph of a standard-library source file: the code between blank
lines (a method, a small function, a block of imports, a docstring), from a few bytes to
thousands. Each document becomes one
row of ``seq_len + 1`` bytes (truncated, or padded with NUL, a byte Python source never holds)
and a mask of its real next-byte targets, so the number of real tokens varies from row to row
and from micro-batch to micro-batch.

The order is grain's: a seeded `grain.MapDataset` (shuffle, repeat, this process's share,
batch), whose iterator state (``{"next_index": n}``) is what a checkpoint stores, so a resumed
run reads exactly the micro-batches an uninterrupted one reads.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator

import numpy as np

PAD = 0  # NUL: never in Python source


def stdlib_files() -> list[str]:
  """The standard library's ``.py`` files, sorted (site-packages left out): a fixed corpus.

  Returns:
    Absolute paths under ``sysconfig.get_paths()["stdlib"]`` of the running interpreter.

  >>> files = stdlib_files()
  >>> any(f.endswith(os.sep + "functools.py") for f in files), files == sorted(files)
  (True, True)
  """
  root = sysconfig.get_paths()["stdlib"]
  found = []
  for directory, subdirs, names in os.walk(root):
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "__pycache__")]
    found.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
  return sorted(found)


def documents(num_docs: int) -> list[bytes]:
  """The first `num_docs` documents (paragraphs of at least 2 bytes) of the corpus.

  Args:
    num_docs: how many documents, a positive int.

  Returns:
    A list of `num_docs` byte strings, in file order then position order (deterministic).

  Raises:
    ValueError: if the standard library holds fewer documents.

  >>> docs = documents(3)
  >>> len(docs), all(isinstance(d, bytes) and len(d) >= 2 for d in docs)
  (3, True)
  """
  docs: list[bytes] = []
  for path in stdlib_files():
    with open(path, "rb") as f:
      docs.extend(d.strip(b"\n") for d in f.read().split(b"\n\n") if len(d.strip()) >= 2)
    if len(docs) >= num_docs:
      return docs[:num_docs]
  raise ValueError(f"documents: num_docs={num_docs} is more than the {len(docs)} available.")


def encode(docs: list[bytes], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows of ``seq_len + 1`` bytes (NUL-padded) and the mask of their real next-byte targets.

  Args:
    docs: the documents.
    seq_len: the model's sequence length.

  Returns:
    ``(tokens, mask)``: int32 ``(len(docs), seq_len + 1)`` and float32 ``(len(docs), seq_len)``;
    ``mask[i, t] = 1`` where ``tokens[i, t + 1]`` is a real byte of document i.

  >>> tokens, mask = encode([b"abc", b"x" * 10], seq_len=4)
  >>> tokens[0].tolist(), mask.sum(axis=1).tolist()
  ([97, 98, 99, 0, 0], [2.0, 4.0])
  """
  tokens = np.full((len(docs), seq_len + 1), PAD, np.int32)
  lengths = np.array([min(len(d), seq_len + 1) for d in docs])
  for i, d in enumerate(docs):
    tokens[i, : lengths[i]] = np.frombuffer(d[: seq_len + 1], np.uint8)
  mask = (np.arange(seq_len)[None, :] < lengths[:, None] - 1).astype(np.float32)
  return tokens, mask


def dataset(tokens, mask, rows: int, *, seed: int, process_index: int = 0, process_count: int = 1):
  """The grain pipeline: shuffled (seeded, a new order each epoch), endless, this process's
  share of the rows, batched into micro-batches of `rows` rows per process.

  Args:
    tokens, mask: the arrays of `encode`.
    rows: rows of one micro-batch on this process.
    seed: the shuffling seed.
    process_index, process_count: this process's share: rows ``process_index::process_count``
      of the shuffled stream (every process reads its own rows of each global micro-batch).

  Returns:
    A `grain.MapDataset` of ``{"tokens", "mask"}`` micro-batches; ``iter()`` of it is a
    checkpointable iterator (``get_state``/``set_state``; tests/test_lm.py restores one). No
    doctest: grain is an optional dependency, and the installed package's doctests run
    without it.
  """
  grain = _grain()
  ds = grain.MapDataset.source(np.arange(len(tokens))).shuffle(seed=seed).repeat(None)
  ds = ds[process_index::process_count]
  ds = ds.map(lambda i: {"tokens": tokens[i], "mask": mask[i]})
  return ds.batch(rows, drop_remainder=True)


def windows(it: Iterator, k: int, steps: int) -> list[list[dict]]:
  """`steps` windows of `k` micro-batches each, read from the iterator `it`."""
  return [[next(it) for _ in range(k)] for _ in range(steps)]


def _grain():
  from optax_accum.demo.lm import require  # noqa: PLC0415

  return require("grain")
