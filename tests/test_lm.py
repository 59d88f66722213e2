"""The language-model task's pieces: the corpus, the grain pipeline, the token-weighted loss.

The task end to end is in tests/test_demo.py (``demo lm --quick``); killed and resumed runs in
tests/test_lm_killed.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum.demo.lm import data, model, require

SEQ = 32


@pytest.fixture(scope="module")
def corpus():
  return data.encode(data.documents(64), SEQ)


def test_lm_documents_are_deterministic_with_natural_lengths(corpus):
  tokens, mask = corpus
  again, _ = data.encode(data.documents(64), SEQ)
  np.testing.assert_array_equal(tokens, again)
  real = mask.sum(axis=1)
  assert real.min() < SEQ / 2 and real.max() == SEQ  # short documents padded, long ones cut
  assert np.all(tokens[:, 1:][mask == 0] == data.PAD)  # every masked target is padding
  assert np.all(tokens[:, 1:][mask == 1] != data.PAD)


def test_lm_documents_rejects_more_than_the_corpus_holds():
  with pytest.raises(ValueError, match=r"num_docs=\d+ is more than the \d+ available"):
    data.documents(10**9)


def test_lm_dataset_restored_iterator_reads_the_same_micro_batches(corpus):
  tokens, mask = corpus
  it = iter(data.dataset(tokens, mask, 4, seed=3))
  for _ in range(5):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(20)]  # past the end of the first epoch (16 micro-batches)
  resumed = iter(data.dataset(tokens, mask, 4, seed=3))
  resumed.set_state(state)
  for a, b in zip(want, [next(resumed) for _ in range(20)], strict=True):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  other = next(iter(data.dataset(tokens, mask, 4, seed=4)))  # the seed sets the order
  assert not np.array_equal(
    other["tokens"], next(iter(data.dataset(tokens, mask, 4, seed=3)))["tokens"]
  )


def test_lm_dataset_processes_read_disjoint_shares_of_one_stream(corpus):
  tokens, mask = corpus
  rows = lambda ds: [r.tobytes() for b in data.windows(iter(ds), 4, 1)[0] for r in b["tokens"]]  # noqa: E731
  one = rows(data.dataset(tokens, mask, 4, seed=0))
  two = [
    rows(data.dataset(tokens, mask, 2, seed=0, process_index=i, process_count=2)) for i in (0, 1)
  ]
  assert two[0] == one[0::2] and two[1] == one[1::2]


def test_lm_token_weighted_micro_batches_give_the_large_batch_loss(corpus):
  tokens, mask = corpus
  graphdef, params = model.init(model.Config(seq_len=SEQ, width=16, heads=2, layers=1), 0)
  loss = jax.jit(model.loss_fn(graphdef))
  batch = {"tokens": tokens[:8], "mask": mask[:8]}
  micro = [{"tokens": tokens[i : i + 2], "mask": mask[i : i + 2]} for i in range(0, 8, 2)]
  weights = np.array([float(model.real_tokens(params, mb)) for mb in micro])
  assert len(set(weights)) > 1  # the micro-batches hold different numbers of real tokens
  means = np.array([float(loss(params, mb)) for mb in micro])
  large = float(loss(params, batch))
  assert np.dot(means, weights) / weights.sum() == pytest.approx(large, rel=1e-6)
  assert abs(means.mean() - large) > 1e-3  # the naive mean of means is another number
  assert jnp.isfinite(large)


def test_lm_missing_extra_says_how_to_install():
  with pytest.raises(ImportError, match=r"pip install 'optax-accum\[examples\]'"):
    require("grain.no_such_module")
