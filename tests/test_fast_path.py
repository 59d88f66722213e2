"""The default path is the fast path: exact where it drops; the compiled structure it is fast by.

Speed itself is measured in benchmarks/ (never timed here). These tests pin down what makes
``accumulate(adam, k)`` with its safe defaults as fast as a plain Adam step on CPU, on the
compiled program (its HLO text and XLA's memory analysis), and that none of it changed which
micro-batches count:

* the finite check is exact at the top of every dtype's range and lowers to one read of each
  gradient (a matrix-vector `dot`), with no parameter-shaped constant;
* the mean is a multiply XLA fuses into the inner update (no parameter-sized temporary; at most
  one ulp from ``sums / total``);
* the protocol's accumulating program needs no temporary beyond the gradients themselves, and
  `TrainStep`'s programs (gradients written into their donated buffer) none at all.
"""

from __future__ import annotations

import functools

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum.core import _core, _hlo

# A problem whose leaves are large enough that a parameter-sized temporary stands out from the
# activations (64 KiB per 128x128 weight against 4 KiB of activations per layer).
SIZES = (32, 128, 128, 128, 4)
PARAMS = ref.mlp_params(0, SIZES)
BATCH = ref.regression_data(1, 8, d_in=SIZES[0], d_out=SIZES[-1])
GRAD_BYTES = sum(x.nbytes for x in jax.tree.leaves(PARAMS))
LARGEST_LEAF = max(x.nbytes for x in jax.tree.leaves(PARAMS))


def _protocol(tx):
  def step(params, state, batch):
    return ref.step(tx, ref.mlp_loss, params, state, batch)

  return step


def _compile_protocol(tx):
  return _hlo.compile_fn(_protocol(tx), PARAMS, tx.init(PARAMS), BATCH, donate_argnums=(0, 1))


# ----------------------------------------------------------------------------------------------
# The finite check: exact for every dtype.

FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64]


def _with(x: np.ndarray, index: int, value) -> np.ndarray:
  y = np.array(x)
  y.reshape(-1)[index] = value
  return y


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (5,), (33, 17), (3, 4, 5)])
def test_finite_check_keeps_the_largest_finite_values(dtype, shape):
  """A leaf full of ±max (3.4e38 in float32, 65504 in float16) is finite: no overflow."""
  big = np.full(shape, jnp.finfo(dtype).max, dtype)
  check = jax.jit(_core.all_finite)
  assert bool(check({"a": big, "b": -big}))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_finite_check_finds_one_bad_element_anywhere(dtype, value):
  x = np.full((33, 17), jnp.finfo(dtype).max / 2, dtype)
  check = jax.jit(_core.all_finite)
  for index in (0, 17 * 16, x.size - 1):
    assert not bool(check({"a": np.ones(3, dtype), "b": _with(x, index, value)})), index


def test_finite_check_reads_the_imaginary_part():
  x = np.zeros((4, 5), np.complex64)
  check = jax.jit(_core.all_finite)
  assert bool(check(x + 3e38j))
  for value in (complex(0, np.nan), complex(0, np.inf), complex(np.nan, 0)):
    assert not bool(check(_with(x, 7, value)))


@pytest.mark.parametrize("pooled", [False, True], ids=["per-leaf", "pooled"])
def test_finite_check_is_exact_for_float64(pooled):
  with jax.enable_x64(True):
    big = np.full((9, 7), np.finfo(np.float64).max, np.float64)
    check = jax.jit(functools.partial(_core.all_finite, pooled=pooled))
    assert bool(check(big)) and bool(check(-big))
    assert not bool(check(_with(big, 62, np.inf))) and not bool(check(_with(big, 0, np.nan)))


def _mixed_tree(rng: np.random.Generator) -> dict:
  """Leaves that take every road of the check's pools (`_core.all_finite`): small ones joined as
  they are, larger ones as row sums, more than one pool's worth of small leaves (a full pool is
  summed and a new one begun), a leaf of so many rows that it is summed alone, the narrow and
  complex ones checked leaf by leaf, an integer leaf, an empty one."""
  f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 1e3  # noqa: E731
  tree = {f"small{i}": f32(*shape) for i, shape in enumerate([(), (7,), (32, 10), (64, 64)])}
  tree |= {f"row{i}": f32(*shape) for i, shape in enumerate([(784, 32), (3, 5, 700), (9000,)])}
  tree |= {f"many{i}": f32(4096) for i in range(20)}  # 81,920 elements: two pools
  # Row sums summed alone: in 32 rows of a literal's width, and beyond one (a plain sum).
  tree |= {"tall": f32(70_000, 1), "taller": f32(140_000, 1)}
  tree |= {"bf16": f32(33, 17).astype(jnp.bfloat16)}
  tree |= {"c64": (f32(6, 5) + 1j * f32(6, 5)).astype(np.complex64)}
  tree |= {"int": np.arange(5, dtype=np.int32), "empty": np.zeros((0, 3), np.float32)}
  return tree


@pytest.mark.parametrize("pooled", [False, True], ids=["per-leaf", "pooled"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_finite_check_agrees_with_numpy_for_a_bad_element_in_each_leaf(value, pooled):
  """Against NumPy's `isfinite`: one bad element in any leaf, at a random place, is found;
  none, and the largest finite values everywhere, pass."""
  rng = np.random.default_rng(0)
  tree = _mixed_tree(rng)
  check = jax.jit(functools.partial(_core.all_finite, pooled=pooled))
  assert bool(check(tree))
  big = {k: np.full_like(x, jnp.finfo(x.dtype).max) if x.dtype != np.int32 else x
         for k, x in tree.items()}  # fmt: skip
  assert bool(check(big)) and bool(check(jax.tree.map(np.negative, big)))
  for name, x in tree.items():
    if x.dtype == np.int32 or not x.size:
      continue
    for index in (0, int(rng.integers(x.size)), x.size - 1):
      bad = dict(tree, **{name: _with(x, index, value)})
      want = all(np.isfinite(np.asarray(y, np.complex128)).all() for y in bad.values())
      assert not want  # (NumPy sees the bad element)
      assert bool(check(bad)) == want, (name, index)


@pytest.mark.structure
@pytest.mark.parametrize("pooled", [False, True], ids=["per-leaf", "pooled"])
def test_finite_check_dots_ask_for_full_precision(pooled):
  """The check's row sums are `dot`s: at a TPU's default matmul precision (a bfloat16 pass) or
  a GPU's (TF32) the float32 largest value rounds to Inf, and a finite gradient would be
  dropped. Each dot asks for HIGHEST (CPU computes float32 either way, so the lowered program
  is what can be checked here)."""
  check = functools.partial(_core.all_finite, pooled=pooled)
  leaves = (jnp.ones((512, 64)), jnp.ones((4100,)), jnp.ones((4, 5), jnp.complex64))
  text = jax.jit(check).lower(leaves).as_text()
  dots = [line for line in text.split("\n") if "dot_general" in line]
  # One per leaf, and the pool's own (its 513 row sums laid out as rows, `_core._pooled`).
  assert len(dots) == 3 + pooled and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots


@pytest.mark.structure
def test_finite_check_of_many_small_leaves_is_one_sum():
  """The pool (`pooled=True`, `TrainStep`'s programs for a small model on one device): 40
  float32 leaves that are each small are joined and summed once, where the default check, one
  per leaf, is 40 reductions at least. The join's 3,200 elements are summed as 32 rows by one
  `dot` and those 32 sums by one `reduce` (summed as they come, XLA:CPU would take three
  `reduce-window` steps). XLA:CPU pays each operation a fixed dispatch whatever its size, and a
  small model's micro-step is made of such operations."""

  def reductions(check):
    leaves = [jax.ShapeDtypeStruct((32,) if i % 2 else (16, 8), jnp.float32) for i in range(40)]
    compiled = _hlo.compile_fn(lambda *xs: check(xs), *leaves)
    comps, entry = _hlo.computations(compiled.text)
    return [i.name for i in comps[entry] if "reduce" in i.name or i.op in ("reduce", "dot")]

  pooled = functools.partial(_core.all_finite, pooled=True)
  assert len(reductions(_core.all_finite)) >= 40
  assert len(reductions(pooled)) == 2 and not any("window" in r for r in reductions(pooled))


@pytest.mark.structure
@pytest.mark.parametrize("pooled", [False, True], ids=["per-leaf", "pooled"])
def test_finite_check_runs_no_broadcast(pooled):
  """The scale vectors of the check's `dot`s are literals of the program (`_core._scales`), not
  `broadcast`s that XLA:CPU would run on every call: on the optax notebook MLP's gradient the
  pooled check is four operations (a row-sum `dot` of the 784×32 weight, the join, the pool's
  `dot`, the final sum), where uniform scales and a plain sum took six."""
  shapes = [(784, 32), (32,), (32, 32), (32,), (32, 10), (10,)]
  leaves = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
  check = functools.partial(_core.all_finite, pooled=pooled)
  compiled = _hlo.compile_fn(lambda *xs: check(xs), *leaves)
  comps, entry = _hlo.computations(compiled.text)
  ran = [i for i in comps[entry] if i.op not in ("parameter", "constant", "bitcast", "tuple")]
  assert not any("broadcast" in i.name or i.op == "broadcast" for i in ran), ran
  if pooled:
    assert len(ran) == 4, [i.name for i in ran]


@pytest.mark.structure
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64], ids=lambda d: jnp.dtype(d).name)
def test_finite_check_is_one_dot_per_leaf_with_no_temporary(dtype):
  """The cheap form: a matrix-vector `dot` reads the leaf once; no squares, no leaf-sized temp."""
  x = jax.ShapeDtypeStruct((512, 256), dtype)
  compiled = _hlo.compile_fn(_core.all_finite, x)
  comps, entry = _hlo.computations(compiled.text)
  ops = [i.op for i in comps[entry]]
  assert ops.count("dot") == 1, ops
  nbytes = 512 * 256 * jnp.dtype(dtype).itemsize
  assert compiled.memory["temp"] < nbytes // 64, compiled.memory


# ----------------------------------------------------------------------------------------------
# Exactness: exactly the non-finite micro-batches are dropped, at any position.


def _grads(seed: int, k: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  return [
    {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": rng.standard_normal(5, np.float32)}
    for _ in range(k)
  ]


@pytest.mark.parametrize("front_end", ["protocol", "train_step"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("bad", [0, 2, 3])  # first, middle, the emitting micro-step
def test_nonfinite_micro_batch_dropped_exactly_at_any_position(front_end, value, bad):
  """k=4 micro-batches, one poisoned: the update is the mean of exactly the other three."""
  k = 4
  grads = _grads(bad, k)
  grads[bad]["w"] = _with(grads[bad]["w"], 7 * bad + 1, value)
  want = jax.tree.map(lambda *g: -np.mean(g, axis=0), *[g for i, g in enumerate(grads) if i != bad])
  params = jax.tree.map(np.zeros_like, grads[0])
  if front_end == "protocol":
    tx = optax_accum.accumulate(optax.sgd(1.0), k)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
      updates, state = update(g, state, params)
    got = updates
  else:
    # The loss's gradient with respect to p is the micro-batch's row: grad(<p, g>) = g.
    loss = lambda p, g: sum(jnp.vdot(p[n], g[n]) for n in p)
    step = optax_accum.TrainStep(loss, optax.sgd(1.0), k)
    state = step.init(params)
    new = params
    for g in grads:
      new, state, _ = step(new, state, g)
    got = new  # params start at zero: after one window they are the update
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 1


@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: d.__name__
)
def test_largest_finite_gradients_are_kept(dtype):
  """A gradient at the dtype's max is a real gradient: kept, and averaged in float32."""
  big = float(jnp.finfo(dtype).max)
  grads = [np.full(3, big, dtype), np.zeros(3, dtype), np.full(3, -big, dtype), np.zeros(3, dtype)]
  tx = optax_accum.accumulate(optax.sgd(1.0), 4)
  state = tx.init(np.zeros(3, dtype))
  update = jax.jit(tx.update)
  updates = []
  for i, g in enumerate(grads[:3]):
    u, state = update(g, state, np.zeros(3, dtype), force_emit=i == 1)
    updates.append(np.asarray(u, np.float32))
  # Window 1 closes on the second call: -(big + 0) / 2 (averaged in float32, so the sum does
  # not overflow); window 2 is still open after -big: zeros.
  np.testing.assert_array_equal(updates[1], np.full(3, -big / 2, np.float32))
  np.testing.assert_array_equal(updates[2], np.zeros(3, np.float32))
  assert int(state.num_skipped) == 0
  first = jax.jit(tx.update, static_argnames="emit")
  u, s = first(grads[0], tx.init(np.zeros(3, dtype)), None, force_emit=True)
  np.testing.assert_array_equal(np.asarray(u, np.float32), np.full(3, -big, np.float32))
  assert int(s.num_skipped) == 0


@pytest.mark.parametrize("total", [3.0, 4.0, 0.7, 12345.678])
def test_mean_is_within_one_ulp_of_the_division(total):
  """``sums * (1 / total)`` against the float32 division the mean was before: at most one ulp
  apart, and identical when the total is a power of two."""
  sums = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * 1e3
  total = np.float32(total)
  got = jax.jit(lambda s, t: _core.normalise(s, t, s, "mean"))(sums, total)
  np.testing.assert_array_max_ulp(np.asarray(got), sums / total, maxulp=1)
  if total in (4.0,):
    np.testing.assert_array_equal(np.asarray(got), sums / total)


# ----------------------------------------------------------------------------------------------
# The compiled structure the speed comes from.


def _constant_arrays(text: str, min_bytes: int) -> list[str]:
  """Entry instructions that materialise an array of at least `min_bytes` from constants only
  (a broadcast scale, zeros): a full pass over memory that computes nothing."""
  comps, entry = _hlo.computations(text)
  constants = {i.name for i in comps[entry] if i.op == "constant"}
  found = []
  for i in comps[entry]:
    if i.op not in ("fusion", "broadcast") or _hlo.shape_bytes(i.shape) < min_bytes:
      continue
    operands = [o.strip().lstrip("%") for o in i.rest.split(")")[0].split(",") if o.strip()]
    if all(o in constants for o in operands):
      found.append(f"{i.name} = {i.shape} {i.op}")
  return found


@pytest.mark.structure
def test_constant_array_detector_sees_a_broadcast_scale():
  """The positive control: the scaled sum of squares the check used to be, over two leaves of one
  shape, writes its 2⁻⁶⁴ scale out as a full leaf-shaped array that both reductions read."""
  squares = lambda g: jnp.sum(jnp.square(g * jnp.float32(2.0**-64)))
  old = lambda a, b: jnp.isfinite(squares(a) + squares(b))
  new = lambda a, b: _core.all_finite((a, b))
  x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
  assert _constant_arrays(_hlo.compile_fn(old, x, x).text, 512 * 256 * 4) != []
  assert _constant_arrays(_hlo.compile_fn(new, x, x).text, 512 * 256 * 4) == []


@pytest.mark.structure
@pytest.mark.parametrize("k", [1, 4])
def test_default_programs_materialise_no_parameter_shaped_constant(k):
  tx = optax_accum.accumulate(optax.adam(1e-3), k)
  assert _constant_arrays(_compile_protocol(tx).text, LARGEST_LEAF) == []
  step = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-3), k)
  for emit in (False, True) if k > 1 else (True,):
    text = step.lower(PARAMS, step.init(PARAMS), BATCH, emit=emit).compile().as_text()
    assert _constant_arrays(text, LARGEST_LEAF) == [], emit


@pytest.mark.structure
@pytest.mark.parametrize("k", [1, 4])
def test_protocol_default_temp_is_at_most_adam_plus_the_gradients(k):
  """The check must see every gradient before any is added (one micro-batch drops as a whole),
  so the gradients are alive together; nothing else may be: no zeros, no updates output of a
  conditional, no materialised mean. Without the check, temp stays under plain Adam's."""
  adam = optax.adam(1e-3)
  floor = _compile_protocol(adam).memory["temp"]
  default = _compile_protocol(optax_accum.accumulate(adam, k))
  assert default.memory["temp"] <= floor + GRAD_BYTES, (default.memory, floor)
  assert default.hlo.copy_bytes < LARGEST_LEAF, default.hlo.copies_where
  if k > 1:
    unchecked = _compile_protocol(optax_accum.accumulate(adam, k, skip_nonfinite=False))
    assert unchecked.memory["temp"] <= floor, (unchecked.memory, floor)


@pytest.mark.structure
@pytest.mark.parametrize("k", [1, 4])
def test_train_step_programs_have_no_parameter_sized_temporary(k):
  """With the gradient buffer (the CPU default) neither program allocates anything the size of a
  parameter per call: gradients go into the donated buffer, the mean is fused into Adam."""
  step = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-3), k, grad_buffer=True)
  state = step.init(PARAMS)
  for emit in (False, True) if k > 1 else (True,):
    memory = _hlo.memory(step.lower(PARAMS, state, BATCH, emit=emit).compile())
    assert memory["temp"] < LARGEST_LEAF, (emit, memory)
  # The positive control: without the buffer the gradients are temporaries again, in the
  # program that computes them: with k > 1 the accumulating one (`lower(emit=True)` is then
  # the closing program, which computes no gradient), with k = 1 the one fused program.
  plain = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-3), k, grad_buffer=False)
  lowered = plain.lower(PARAMS, plain.init(PARAMS), BATCH, emit=k == 1)
  memory = _hlo.memory(lowered.compile())
  assert memory["temp"] >= LARGEST_LEAF, memory


def test_train_step_gradient_buffer_gives_the_same_parameters():
  """The buffer is an implementation detail: same parameters with and without it."""
  k = 3
  batches = ref.split(ref.regression_data(5, 4 * k * 2, d_in=SIZES[0], d_out=SIZES[-1]), 2 * k)
  results = []
  for grad_buffer in (False, True):
    step = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-2), k, grad_buffer=grad_buffer)
    params, state = jax.tree.map(np.copy, PARAMS), None
    state = step.init(params)
    for b in batches:
      params, state, _ = step(params, state, b)
    results.append(params)
  chex.assert_trees_all_equal(*results)
