"""Issue 34, item 9: optax.MultiSteps habits get the library's own error, naming the
replacement (docs/guides/migration.md), instead of Python's bare TypeError/AttributeError."""

from __future__ import annotations

import re

import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa


@pytest.mark.parametrize(
  "kwargs, fix",
  [
    ({"every_k_schedule": 4}, "write every_k=4"),
    ({"every_k": 2, "every_k_schedule": 4}, "write every_k=4"),
    ({"use_grad_mean": False}, "write reduction='sum'"),
    ({"use_grad_mean": True}, "write reduction='mean'"),
    ({"every_k": 2, "should_skip_update_fn": optax.skip_not_finite}, "skip_nonfinite=True"),
    ({"every_k": 2, "should_skip_update_fn": optax.skip_large_updates}, "weight=0.0"),
  ],
)
def test_item9_multisteps_keywords_name_their_replacement(kwargs, fix):
  name = next(k for k in kwargs if k != "every_k")
  with pytest.raises(TypeError, match=re.escape(f"accumulate: {name}= is optax.MultiSteps'")):
    oa.accumulate(optax.sgd(1.0), **kwargs)
  with pytest.raises(TypeError, match=re.escape(fix)):
    oa.accumulate(optax.sgd(1.0), **kwargs)


@pytest.mark.parametrize(
  "attribute, fix",
  [
    ("has_updated", "optax_accum.has_updated(state)"),
    ("gradient_transformation", "already returns an optax.GradientTransformationExtraArgs"),
    ("inner_opt", "keep your own reference"),
  ],
)
def test_item9_multisteps_methods_name_their_replacement(attribute, fix):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  with pytest.raises(AttributeError, match=re.escape(fix)):
    getattr(tx, attribute)
  assert not hasattr(tx, attribute)  # hasattr still answers False


def test_item9_other_mistakes_keep_python_errors_and_the_transformation_is_optax():
  with pytest.raises(TypeError, match="unexpected keyword argument 'every_ks'"):
    oa.accumulate(optax.sgd(1.0), every_ks=2)
  with pytest.raises(TypeError, match="missing 1 required argument: 'every_k'"):
    oa.accumulate(optax.sgd(1.0))
  tx = oa.accumulate(optax.sgd(1.0), 2)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    tx.nope  # noqa: B018
  params = jnp.ones(2)
  chained = optax.chain(tx, optax.scale(1.0))
  chained.update(params, chained.init(params), params)
