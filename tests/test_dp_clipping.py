"""Per-example clipping (`clipped_grad`, `clipped_loss`) against an independent reference.

The reference takes each example's gradient with its own `jax.grad` call (no vmap), clips and
sums in float64 NumPy. The clip norm is the median per-example norm, so half the examples are
clipped and half are not. float32 against float64: 2e-6 of the sum's scale (sums of <= 64 terms).
"""

import _reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa
from optax_accum.core import _hlo

N = 32


def per_example_grads(params, batch, loss=ref.mlp_loss):
  """Each example's gradient, one `jax.grad` call per example (leading axis kept, size 1)."""
  grad = jax.jit(jax.grad(loss))
  out = []
  for i in range(len(batch["x"])):
    g = grad(params, jax.tree.map(lambda v, i=i: v[i : i + 1], batch))
    out.append({k: np.asarray(v, np.float64) for k, v in g.items()})
  return out


def reference_sum(params, batch, clip, mask=None, loss=ref.mlp_loss):
  """Σᵢ clip_C(gᵢ) over the real examples, float64."""
  grads = per_example_grads(params, batch, loss)
  total = {k: np.zeros(v.shape) for k, v in grads[0].items()}
  for i, g in enumerate(grads):
    if mask is not None and not mask[i]:
      continue
    norm = np.sqrt(sum(np.sum(v**2) for v in g.values()))
    scale = min(1.0, clip / norm)
    for k in total:
      total[k] += scale * g[k]
  return total


def median_norm(params, batch, loss=ref.mlp_loss):
  grads = per_example_grads(params, batch, loss)
  return float(np.median([np.sqrt(sum(np.sum(v**2) for v in g.values())) for g in grads]))


def assert_close(actual, expected, rtol=2e-6):
  scale = max(np.max(np.abs(v)) for v in jax.tree.leaves(expected))
  err = ref.max_abs_diff(actual, expected)
  assert err <= rtol * scale, f"max abs diff {err} > {rtol} * {scale}"


@pytest.fixture(scope="module")
def problem():
  params, batch = ref.mlp_params(0), ref.regression_data(1, N)
  return params, batch, median_norm(params, batch)


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_grad_matches_per_example_reference(problem, jit):
  params, batch, clip = problem
  f = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)
  f = jax.jit(f) if jit else f
  assert_close(f(params, batch), reference_sum(params, batch, clip))


def test_clipped_grad_clips_half_and_reports_stats(problem):
  params, batch, clip = problem
  grads, stats = oa.privacy.clipped_grad(ref.mlp_loss, clip, return_stats=True, mask_argnum=None)(
    params, batch
  )
  norms = [np.sqrt(sum(np.sum(v**2) for v in g.values())) for g in per_example_grads(params, batch)]
  np.testing.assert_allclose(stats.norms, norms, rtol=1e-5)
  assert float(stats.num_examples) == N
  assert float(stats.num_clipped) == sum(n > clip for n in norms) == N // 2
  # Each example alone: its clipped gradient has norm min(‖g‖, C).
  f = jax.jit(oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None))
  for i, n in enumerate(norms):
    one = f(params, jax.tree.map(lambda v, i=i: v[i : i + 1], batch))
    clipped = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(one)))
    np.testing.assert_allclose(clipped, min(n, clip), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_clipped_grad_in_microbatch_is_exact_for_every_split(problem, k, split):
  params, batch, clip = problem
  f = oa.microbatch(
    oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None), k, reduction="sum", split=split
  )
  assert_close(jax.jit(f)(params, batch), reference_sum(params, batch, clip))


def test_clipped_grad_padded_examples_change_nothing(problem):
  params, batch, clip = problem
  mask = np.arange(N) % 3 != 0
  real = jax.tree.map(lambda v: v[mask], batch)
  # The padding rows hold garbage (huge values, NaN): masked, they contribute exactly 0.
  garbage = jax.tree.map(lambda v: np.where(mask[:, None], v, np.float32(1e30)), batch)
  garbage["x"][~mask, 0] = np.nan
  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2, return_stats=True)
  f = jax.jit(oa.microbatch(cg, 4, batch_argnums=(1, 2), reduction=cg.reduction))
  grads, stats = f(params, garbage, mask)
  assert_close(grads, reference_sum(params, real, clip))
  assert float(stats.num_examples) == mask.sum()
  np.testing.assert_array_equal(np.asarray(stats.norms)[~mask], 0.0)
  unmasked = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)(params, real)
  assert_close(grads, unmasked)


def test_clipped_grad_nonfinite_example_contributes_zero(problem):
  params, batch, clip = problem
  bad = jax.tree.map(np.array, batch)
  bad["x"][3, 0] = np.inf
  keep = np.arange(N) != 3
  out = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)(params, bad)
  assert_close(out, reference_sum(params, batch, clip, mask=keep))


def test_clipped_loss_gradient_is_clipped_sum(problem):
  params, batch, clip = problem
  f = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  value, grads = jax.jit(jax.value_and_grad(f))(params, batch)
  assert_close(grads, reference_sum(params, batch, clip))
  per_example = [
    ref.mlp_loss(params, jax.tree.map(lambda v, i=i: v[i : i + 1], batch)) for i in range(N)
  ]
  np.testing.assert_allclose(value, np.sum(per_example), rtol=1e-6)


def test_clipped_grad_bf16_params_keep_float32_sums(problem):
  """bfloat16 parameters: the clipped sum stays float32 until the noise (issue 40, item 7):
  rounding it to bfloat16 first moved the update by 1.05·C/B."""
  params, batch, clip = problem
  p16 = jax.tree.map(lambda v: jnp.asarray(v, jnp.bfloat16), params)
  out = oa.privacy.clipped_grad(lambda p, b: ref.mlp_loss(p, b), clip, mask_argnum=None)(p16, batch)
  assert {v.dtype for v in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("clip", [0.0, -1.0, np.inf, np.nan])
@pytest.mark.parametrize("fn", [oa.privacy.clipped_grad, oa.privacy.clipped_loss])
def test_clipped_grad_rejects_bad_clip(fn, clip):
  with pytest.raises(ValueError, match=rf"{fn.__name__}: l2_clip must be a positive finite number"):
    fn(ref.mlp_loss, clip)


def test_clipped_grad_rejects_function_without_batch_argument(problem):
  params, batch, _ = problem
  with pytest.raises(ValueError, match=r"batch_argnums=\(\) is empty.*Per-example clipping"):
    oa.privacy.clipped_grad(ref.mlp_loss, 1.0, batch_argnums=(), mask_argnum=None)
  with pytest.raises(ValueError, match=r"batch_argnums=0 holds 0, the parameters"):
    oa.privacy.clipped_grad(ref.mlp_loss, 1.0, batch_argnums=0, mask_argnum=None)
  loss_of_params_only = lambda p: sum(jnp.sum(v**2) for v in jax.tree.leaves(p))  # noqa: E731
  with pytest.raises(ValueError, match=r"batch_argnums=\(1,\), but the loss got 1 arguments"):
    oa.privacy.clipped_grad(loss_of_params_only, 1.0, mask_argnum=None)(params)
  with pytest.raises(ValueError, match=r"the batch arguments \(1,\) hold no arrays"):
    oa.privacy.clipped_grad(lambda p, b: ref.mlp_loss(p, batch), 1.0, mask_argnum=None)(params, {})


def test_clipped_grad_rejects_mismatched_batch_and_mask(problem):
  params, batch, _ = problem
  uneven = {"x": batch["x"], "y": batch["y"][:5]}
  with pytest.raises(ValueError, match=r"leading sizes differ .*\['x'\]: 32.*\['y'\]: 5"):
    oa.privacy.clipped_grad(ref.mlp_loss, 1.0, mask_argnum=None)(params, uneven)
  f = oa.privacy.clipped_grad(ref.mlp_loss, 1.0, mask_argnum=2)
  with pytest.raises(ValueError, match=r"the mask must have shape \(32,\).*got bool\[5\]"):
    f(params, batch, np.ones(5, bool))
  with pytest.raises(ValueError, match=r"mask_argnum=1 is also in batch_argnums"):
    oa.privacy.clipped_grad(ref.mlp_loss, 1.0, mask_argnum=1)
  with pytest.raises(ValueError, match=r"sensitivity: neighboring_relation must be one of"):
    oa.privacy.clipped_grad(ref.mlp_loss, 1.0, mask_argnum=None).sensitivity("swap")


def test_clipped_grad_planner_picks_microbatch_from_compiled_memory(problem):
  params, batch, clip = problem
  clipped = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)

  def peak(k):
    f = jax.jit(oa.microbatch(clipped, k, reduction="sum"))
    return _hlo.peak_bytes(f.lower(params, batch).compile())

  # The per-example gradients of one micro-batch dominate: the peak shrinks with b = N / k.
  p2, p4 = peak(2), peak(4)
  assert p4 < p2
  plan = oa.plan_microbatches(clipped, params, batch, memory_limit=(p2 + p4) // 2, reduction="sum")
  assert plan.num_microbatches == 4 and plan.peak_bytes[4] == p4


# ----------------------------------------------------------------------------------------------
# Exploding (and vanishing) gradients: any finite gradient is clipped to exactly C·g/‖g‖.


def _linear_loss(p, x):
  """The per-example gradient is the example itself: ∇_a = x[:, :3], ∇_b = x[:, 3:] as (2, 2)."""
  return jnp.sum(x[:, :3] * p["a"]) + jnp.sum(x[:, 3:].reshape(-1, 2, 2) * p["b"])


def _examples_of_norms(norms):
  """One float32 example per norm: a fixed random direction (7 entries, mixed signs) times the
  norm, computed in float64 and rounded once."""
  rng = np.random.default_rng(3)
  d = rng.standard_normal(7)
  d /= np.linalg.norm(d)
  return np.stack([d * n for n in norms]).astype(np.float32)


# 1e-38 (its entries denormal) to 3e38 (near float32's largest), a decade apart.
NORMS = [*(10.0**e for e in range(-38, 39)), 3e38]


@pytest.mark.parametrize("clip", [1.0, 1e-30, 1e30])
def test_clipped_grad_any_finite_norm_clips_exactly_against_float64(clip):
  x = _examples_of_norms(NORMS)
  params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
  f = oa.privacy.clipped_grad(_linear_loss, clip, return_stats=True, mask_argnum=None)
  # Each example alone (a batch of one, vmapped): its own clipped contribution.
  each, stats = jax.jit(jax.vmap(lambda xi: f(params, xi[None])))(x)
  got = np.concatenate([np.asarray(each["a"]), np.asarray(each["b"]).reshape(-1, 4)], axis=1)
  got = got.astype(np.float64)
  x64 = x.astype(np.float64)
  norms64 = np.linalg.norm(x64, axis=1)
  want = x64 * np.minimum(1.0, clip / norms64)[:, None]
  # float32 against float64: 2e-6 of each contribution's norm. XLA:CPU flushes denormals to
  # zero, so an entry below float32's smallest normal (1.2e-38) may come out 0: atol = tiny.
  tiny = np.finfo(np.float32).tiny
  err = np.abs(got - want).max(axis=1)
  bound = 2e-6 * np.linalg.norm(want, axis=1) + tiny
  assert np.all(err <= bound), [
    (n, e, b) for n, e, b in zip(NORMS, err, bound, strict=True) if e > b
  ]
  # The exploding ones (‖g‖² overflows float32 from 1.8e19) have norm C, not 0.
  big = norms64 > max(clip, 1e19)
  np.testing.assert_allclose(np.linalg.norm(got[big], axis=1), clip, rtol=2e-6)
  # The reported norms: to float32 precision from 1e-9 (2^-30), or from C where C is smaller
  # (below both, the plain sum of squares underflows, and the norm does not decide anything).
  reported = np.asarray(stats.norms)[:, 0]
  exact = norms64 >= min(clip, 2.0**-30)
  np.testing.assert_allclose(reported[exact], norms64[exact], rtol=2e-6)
  assert np.all(reported[~exact] < 2.0**-30)
  # The whole batch at once: the float64 sum.
  total = jax.jit(oa.privacy.clipped_grad(_linear_loss, clip, mask_argnum=None))(params, x)
  flat = np.concatenate([np.asarray(total["a"]), np.asarray(total["b"]).ravel()])
  np.testing.assert_allclose(flat, want.sum(0), rtol=0, atol=4e-6 * np.abs(want.sum(0)).max())


def test_clipped_grad_non_finite_entries_still_count_zero():
  x = _examples_of_norms([1.0, 1e30, 1.0])
  x[0, 2] = np.inf
  x[2, 5] = np.nan
  params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
  total, stats = oa.privacy.clipped_grad(_linear_loss, 1.0, return_stats=True, mask_argnum=None)(
    params, x
  )
  flat = np.concatenate([np.asarray(total["a"]), np.asarray(total["b"]).ravel()])
  want = x[1].astype(np.float64) / np.linalg.norm(x[1].astype(np.float64))
  np.testing.assert_allclose(flat, want, rtol=2e-6, atol=1e-7)
  assert float(stats.num_examples) == 3


# ----------------------------------------------------------------------------------------------
# Issue 34, item 19: has_aux / return_values and rescale_to_unit_norm.


def _example_values(params, batch):
  """Each example's loss and prediction, float64, one example at a time (NumPy)."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"], np.float64)
  out = np.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]
  return np.sum((out - y) ** 2, axis=-1), out


def _loss_with_aux(params, batch):
  out = ref.mlp_apply(params, batch["x"])
  return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=-1)), {"out": out}


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_item19_has_aux_returns_per_example_values_and_aux_from_one_pass(problem, split):
  """has_aux and return_values: each example's loss value and aux (0 for padding) against the
  float64 loop, in batch order through microbatch's "concat" (its own reduction); the clipped
  sum is unchanged (the float64 per-example reference); and the loss is traced as often as
  without them: the values come from the forward pass the gradient runs, not a second one."""
  params, batch, clip = problem
  traces = []

  def counted(p, b):
    traces.append(1)
    return _loss_with_aux(p, b)

  mask = np.arange(N) % 5 != 2
  plain = oa.privacy.clipped_grad(lambda p, b: counted(p, b)[0], clip, mask_argnum=2)
  cg = oa.privacy.clipped_grad(counted, clip, mask_argnum=2, has_aux=True, return_values=True)
  step = oa.microbatch(cg, 4, batch_argnums=(1, 2), split=split)
  grads, aux = step(params, batch, mask)
  values, out = _example_values(params, batch)
  np.testing.assert_allclose(aux.values, np.where(mask, values, 0), rtol=2e-6, atol=1e-7)
  assert aux.aux["out"].shape == (N, 2)  # each example's (1, 2) output: one row each
  want = np.where(mask[:, None], out, 0)
  np.testing.assert_allclose(aux.aux["out"], want, rtol=2e-6, atol=1e-6)
  assert aux.stats is None
  assert_close(grads, reference_sum(params, batch, clip, mask))
  traces.clear()
  jax.eval_shape(plain, params, batch, mask)
  without = len(traces)
  traces.clear()
  jax.eval_shape(cg, params, batch, mask)
  assert len(traces) == without == 1
  # return_stats alongside: the ClipAux holds it; alone it keeps its (grads, ClipStats) form.
  both = oa.privacy.clipped_grad(
    ref.mlp_loss, clip, return_values=True, return_stats=True, mask_argnum=None
  )
  _, extra = both(params, batch)
  assert float(extra.stats.num_examples) == N and extra.aux is None
  stats_only = oa.privacy.clipped_grad(ref.mlp_loss, clip, return_stats=True, mask_argnum=None)
  assert isinstance(stats_only(params, batch)[1], oa.privacy.ClipStats)


def test_item19_rescale_to_unit_norm_divides_by_c_and_the_noise_follows(problem):
  """rescale_to_unit_norm: the sum is Σ clip_C(gᵢ)/C (the float64 reference ÷ C), its bound and
  sensitivity 1 (2 under replace-one); dp_noise given the function draws σ·1, so the noised
  update times C is the unscaled run's with the same key and σ: the same mechanism (and ε)
  with the learning rate ÷ C. The same through clipped_loss."""
  params, batch, clip = problem
  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, rescale_to_unit_norm=True, mask_argnum=None)
  want = jax.tree.map(lambda v: v / clip, reference_sum(params, batch, clip))
  assert_close(cg(params, batch), want)
  rescaled_loss = oa.privacy.clipped_loss(
    ref.mlp_loss, clip, rescale_to_unit_norm=True, mask_argnum=None
  )
  assert_close(jax.grad(rescaled_loss)(params, batch), want)
  assert cg.l2_norm_bound == 1.0 and cg.sensitivity() == 1.0
  assert cg.sensitivity("replace_one") == 2.0 and cg.l2_clip == clip
  plain = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)
  key, sigma = jax.random.key(19_019), 0.7
  noised = []
  for fn in (cg, plain):
    tx = oa.privacy.dp_noise(sigma, fn, 32.0, key, allow_key_reuse=True)
    noised.append(tx.update(fn(params, batch), tx.init(params))[0])
  assert_close(jax.tree.map(lambda u: u * clip, noised[0]), noised[1], rtol=1e-5)
  # A number is the bound itself: 1.0 for the rescaled sum draws the same noise.
  tx = oa.privacy.dp_noise(sigma, 1.0, 32.0, key, allow_key_reuse=True)
  assert_close(tx.update(cg(params, batch), tx.init(params))[0], noised[0], rtol=1e-6)
  with pytest.raises(TypeError, match=r"dp_noise: l2_clip must be a number \(the clip norm C\)"):
    oa.privacy.dp_noise(sigma, ref.mlp_loss, 32.0, jax.random.key(19_020))
  with pytest.raises(TypeError, match=r"clipped_grad: rescale_to_unit_norm must be a bool"):
    oa.privacy.clipped_grad(ref.mlp_loss, clip, rescale_to_unit_norm="yes", mask_argnum=None)


def test_item19_rescale_refuses_noise_scaled_to_c():
  """The inconsistent combination: a rescaled clipped function (bound 1) and dp_noise told its
  C as a number (noise σ·C, while the accountant is told σ for a bound of 1) raises, naming the
  fix; the function itself or 1.0 is accepted. A plain clipped function with the same C alive
  beside it makes C a legitimate bound again (the noise may be for that one)."""
  c = 0.37
  rescaled = oa.privacy.clipped_loss(ref.mlp_loss, c, rescale_to_unit_norm=True, mask_argnum=None)
  with pytest.raises(ValueError, match=r"dp_noise: l2_clip is the clip norm C .* l2_clip=0\.37"):
    oa.privacy.dp_noise(1.0, c, 8.0, jax.random.key(19_030))
  oa.privacy.dp_noise(1.0, rescaled, 8.0, jax.random.key(19_031))
  oa.privacy.dp_noise(1.0, 1.0, 8.0, jax.random.key(19_032))
  plain = oa.privacy.clipped_grad(ref.mlp_loss, c, mask_argnum=None)
  oa.privacy.dp_noise(1.0, c, 8.0, jax.random.key(19_033))
  assert plain.l2_norm_bound == c and rescaled.l2_norm_bound == 1.0


# ----------------------------------------------------------------------------------------------
# clipped_loss(has_aux=True): each example's aux beside the clipped gradient.

MASK = np.arange(N) % 5 != 2  # every fifth example padding


def _aux_loss(params, batch):
  """`_loss_with_aux`, plus an integer aux (no cotangent): each example's larger output."""
  loss, aux = _loss_with_aux(params, batch)
  return loss, {**aux, "argmax": jnp.argmax(aux["out"], axis=-1)}


def _aux_reference(params, batch):
  """The summed loss, each example's aux rows (padding 0) and the clipped sum, float64."""
  values, out = _example_values(params, batch)
  rows = {"out": np.where(MASK[:, None], out, 0), "argmax": np.where(MASK, out.argmax(-1), 0)}
  return np.sum(values[MASK]), rows


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_loss_has_aux_matches_clipped_grad_and_float64_reference(problem, jit):
  params, batch, clip = problem
  f = oa.privacy.clipped_loss(_aux_loss, clip, mask_argnum=2, has_aux=True)
  assert f.has_aux and not oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None).has_aux
  vg = jax.value_and_grad(f, has_aux=True)
  (value, aux), grads = (jax.jit(vg) if jit else vg)(params, batch, MASK)
  cg = oa.privacy.clipped_grad(_aux_loss, clip, mask_argnum=2, has_aux=True, return_values=True)
  cg_grads, cg_aux = cg(params, batch, MASK)
  # clipped_grad's own outputs, from the same computation
  assert_close(grads, cg_grads, rtol=1e-7)
  np.testing.assert_allclose(value, np.sum(cg_aux.values), rtol=1e-6)
  for name in ("out", "argmax"):
    np.testing.assert_array_equal(aux[name], cg_aux.aux[name])
  # ... and the float64 per-example reference
  want_value, want_rows = _aux_reference(params, batch)
  np.testing.assert_allclose(value, want_value, rtol=2e-6)
  np.testing.assert_allclose(aux["out"], want_rows["out"], rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(aux["argmax"], want_rows["argmax"])
  assert aux["argmax"].dtype == jnp.int32
  assert_close(grads, reference_sum(params, batch, clip, MASK))
  # jax.grad: (gradient, aux)
  g, aux_g = jax.grad(f, has_aux=True)(params, batch, MASK)
  assert_close(g, grads, rtol=1e-7)
  np.testing.assert_array_equal(aux_g["out"], aux["out"])


def test_clipped_loss_has_aux_in_train_step_and_microbatch(problem):
  """TrainStep(has_aux=True) returns each micro-batch's aux rows (with axis_name, the devices'
  rows joined in the batch's order) and the same parameters as without aux; microbatch
  concatenates the rows in the batch's order beside the same clipped sum."""
  params, batch, clip = problem
  _, want_rows = _aux_reference(params, batch)
  f = oa.privacy.clipped_loss(_aux_loss, clip, mask_argnum=2, has_aux=True)
  plain = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=2)
  halves = [slice(0, N // 2), slice(N // 2, N)]
  mesh = jax.make_mesh((8,), ("data",))

  def run(loss, **kw):
    # σ = 0 and B = 1: the clipped sum itself (TrainStep needs both halves of the mechanism)
    noise = oa.privacy.dp_noise(0.0, clip, 1.0, jax.random.key(0))
    inner = optax.chain(noise, optax.sgd(0.1))
    step = oa.TrainStep(loss, inner, every_k=2, reduction="sum", donate=False, **kw)
    p, values = jax.tree.map(jnp.asarray, params), []
    state = step.init(p)
    for rows in halves:
      p, state, value = step(p, state, jax.tree.map(lambda v, r=rows: v[r], batch), MASK[rows])
      values.append(value)
    return p, values

  want_params, _ = run(plain)
  for kw in ({}, {"axis_name": "data", "mesh": mesh}):
    got_params, values = run(f, has_aux=True, **kw)
    assert_close(got_params, want_params, rtol=1e-6)
    for rows, (_, aux) in zip(halves, values, strict=True):
      np.testing.assert_allclose(aux["out"], want_rows["out"][rows], rtol=2e-6, atol=1e-6)
      np.testing.assert_array_equal(aux["argmax"], want_rows["argmax"][rows])
  step = oa.microbatch(
    jax.value_and_grad(f, has_aux=True),
    4,
    batch_argnums=(1, 2),
    reduction=(("sum", "concat"), "sum"),
  )
  (value, aux), grads = step(params, batch, MASK)
  np.testing.assert_allclose(aux["out"], want_rows["out"], rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(aux["argmax"], want_rows["argmax"])
  assert_close(grads, reference_sum(params, batch, clip, MASK))


def test_clipped_loss_has_aux_mistakes_raise_naming_the_fix(problem):
  params, batch, clip = problem
  with pytest.raises(TypeError, match=r"clipped_loss: has_aux must be a bool, got 'yes'\."):
    oa.privacy.clipped_loss(_aux_loss, clip, has_aux="yes", mask_argnum=None)
  f = oa.privacy.clipped_loss(_aux_loss, clip, has_aux=True, mask_argnum=None)
  returns_aux = r"clipped_loss\(\.\.\., has_aux=True\), which returns \(loss, aux\), but has_aux"
  with pytest.raises(ValueError, match=returns_aux + r"=False\. Pass has_aux=True to TrainStep"):
    oa.TrainStep(f, optax.sgd(0.1), every_k=2, reduction="sum")
  plain = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  with pytest.raises(ValueError, match=r"has_aux=True, but loss_fn is privacy\.clipped_loss wi"):
    oa.TrainStep(plain, optax.sgd(0.1), every_k=2, reduction="sum", has_aux=True)
  named = r"reduction=\(\('sum', 'concat'\), 'sum'\) for jax\.value_and_grad\(f, has_aux=True\)"
  with pytest.raises(ValueError, match=named):
    oa.microbatch(jax.value_and_grad(f, has_aux=True), 4)
