"""The privacy contract: every option of the front ends on a private path, kept, made right or
refused, in one table that the checks, the privacy guide and `tests/test_dp_contract.py` share.

A path is private when a `dp_noise` sits in the inner optimizer of `accumulate`/`TrainStep`
(found in its state at ``init``) or when the function given to `microbatch`/`TrainStep` is a
clipped one (`clipped_grad`, `clipped_loss`, what `jax.grad`/`jax.value_and_grad` make of them,
or any function with ``__dp_private__ = True``). The core recognises both without importing
this package (`optax_accum.core._checks`); the errors of the refused rows are its
`PRIVATE_REFUSED` messages, named here by key, so the table and the checks say the same thing.

Verdicts: "kept" — the option changes neither the sensitivity (one example moves the update by
at most ``C/B``) nor the noise nor the sampling, and the test measures it on neighbouring data
sets; "made right" — the option does something else on a private path (said in the row), and
the test measures that too; "refused" — construction or ``init`` (or, for a per-call argument,
the first call, before anything runs) raises the row's error.
"""

from __future__ import annotations

from typing import NamedTuple

from optax_accum.core import _checks
from optax_accum.privacy import _guard

#: Every refused row's message by key: the core's checks' and the privacy package's own.
MESSAGES = {**_checks.PRIVATE_REFUSED, **_guard.REFUSED}

KEPT, MADE_RIGHT, REFUSED = "kept", "made right", "refused"


class ContractRow(NamedTuple):
  """One row of the privacy contract."""

  # "accumulate", "TrainStep", "microbatch", "data_parallel", "dp_epsilon" or "layout"
  front: str
  option: str  # the option (or layout) as written in code
  verdict: str  # KEPT, MADE_RIGHT or REFUSED
  why: str  # what it does on a private path, in one sentence
  error: str | None = None  # REFUSED: the key of its message in `MESSAGES`

  @property
  def id(self) -> str:
    """A stable name for the row (the test of the row is keyed by it)."""
    return f"{self.front}:{self.option}"

  @property
  def message(self) -> str | None:
    """The error's text (with ``{caller}`` the front end), or None for a row that is not
    refused."""
    if self.error is None:
      return None
    return MESSAGES[self.error].replace("{caller}", self.front).replace("{ON}", "on a private path")


_R = ContractRow
_SUM = "the clipped sums are added; the noise is drawn once per update, after them"


class _Rows(tuple):
  """The rows, shown briefly (the table itself: `contract_table`)."""

  def __repr__(self) -> str:
    return f"<the privacy contract: {len(self)} ContractRow rows; contract_table() shows them>"


#: The privacy contract: one `ContractRow` per option (or layout) of each front end on a
#: private path, verdict "kept", "made right" or "refused". The checks raise the refused rows'
#: messages; the privacy guide prints `contract_table()`; ``tests/test_dp_contract.py`` runs
#: every row.
CONTRACT: tuple[ContractRow, ...] = _Rows((
  # accumulate(inner, every_k, ...) and its update(grads, state, params, ...)
  _R("accumulate", "inner=chain(dp_noise(...), ...)", KEPT,
     "dp_noise runs once per window, on the emitting step, after the one all-reduce"),
  _R("accumulate", "inner=inject_hyperparams(lambda lr: chain(dp_noise(...), ...))", KEPT,
     "a hyperparameter set from the loop (a learning rate) changes what follows the noise only; "
     "build dp_noise once, outside the factory (optax calls it on every update)"),
  _R("accumulate", "inner holding scale_by_gain", REFUSED,
     "a gain from the un-noised clipped sums scales the noised update", "scale_by_gain"),
  _R("accumulate", "every_k=int", KEPT, _SUM),
  _R("accumulate", "every_k=schedule", KEPT,
     "a public schedule of window lengths: the data never choose a window"),
  _R("accumulate", "every_k=FollowNoiseScale(...)", REFUSED,
     "window lengths chosen from the un-noised clipped sums", "follow_noise_scale"),
  _R("accumulate", 'reduction="sum"', KEPT, _SUM),
  _R("accumulate", 'reduction="mean"', REFUSED,
     "divides by the realised number of micro-batches (data-dependent)", "reduction_mean"),
  _R("accumulate", "accum_dtype=float32", KEPT, "sums at least in float32 (the default)"),
  _R("accumulate", "accum_dtype narrower than float32", REFUSED,
     "rounding the running sum breaks the C bound", "accum_dtype"),
  _R("accumulate", "skip_nonfinite=True", KEPT,
     "judges the gradient leaves only: clipped sums are finite by construction (a non-finite "
     "per-example gradient counts 0)"),
  _R("accumulate", "skip_nonfinite=False", KEPT, _SUM),
  _R("accumulate", 'skip_nonfinite="window"', KEPT,
     "a window is dropped only if its sums are not finite, which clipped sums never are (a "
     "non-finite per-example gradient counts 0; n clipped gradients sum to at most n·C, far "
     "below float32's overflow); a dropped window (a gradient clipping did not make) makes, "
     "like an empty one, the noisy update of zero sums: the noisy update always happens and "
     "is counted, with or without axis_name, and its micro-batches count in num_skipped"),
  _R("accumulate", "empty window", MADE_RIGHT,
     "a window whose every micro-batch was dropped still makes the noisy update, counted by "
     "dp_updates (the accountant counts every window)"),
  _R("accumulate", 'axis_name="data"', KEPT,
     "the devices' clipped sums meet in the one all-reduce; the noise is drawn once, after it"),
  _R("accumulate", "noise_scale=True", REFUSED,
     "releases statistics of the un-noised clipped sums", "noise_scale"),
  _R("accumulate", "update(weight=...)", REFUSED,
     "multiplies the clipped sums (raised at the first update's trace, before it runs)",
     "weight"),
  _R("accumulate", "update(force_emit=...)", KEPT,
     "a short window (e.g. a small Poisson draw) sums fewer clipped gradients; the noise and "
     "the divisor B are the same (force_emit must be public, e.g. the sampler's count)"),
  _R("accumulate", "update(emit=...)", KEPT, "the same window, without a device conditional"),
  _R("accumulate", "the state saved right after an update (a window boundary)", MADE_RIGHT,
     "the emitting step zeroes the spent clipped sums and window weight (lazily reset "
     "otherwise), with or without axis_name or emit=: the saved state and the parameters "
     "together move by at most C/B, and resuming from it is bit-exact; a state saved mid-window "
     "holds the open window's un-noised sums (secret)"),
  _R("accumulate", "inner=chain(<anything>, dp_noise(...), ...)", REFUSED,
     "what stands before the noise acts on the un-noised clipped sums (a statistic of the data "
     "or a change of scale: scale_by_adam, scale_by_rms, scale, masked, multi_transform)",
     "noise_not_first"),
  _R("accumulate", "gradients narrower than float32 (bfloat16 parameters)", REFUSED,
     "each micro-step's clipped sum rounded to bfloat16 before the noise", "narrow_sums"),
  # TrainStep(loss_fn, inner, every_k, ...) and its call
  _R("TrainStep", "loss_fn=clipped_loss(...)", KEPT, _SUM),
  _R("TrainStep", "inner holding scale_by_gain", REFUSED,
     "a gain from the un-noised clipped sums scales the noised update", "scale_by_gain"),
  _R("TrainStep", "every_k=FollowNoiseScale(...)", REFUSED,
     "window lengths chosen from the un-noised clipped sums", "follow_noise_scale"),
  _R("TrainStep", 'reduction="mean"', REFUSED,
     "divides by the realised number of micro-batches (data-dependent)", "reduction_mean"),
  _R("TrainStep", "accum_dtype narrower than float32", REFUSED,
     "rounding the running sum breaks the C bound", "accum_dtype"),
  _R("TrainStep", "loss_fn=clipped_loss(..., rescale_to_unit_norm=True)", MADE_RIGHT,
     "each clipped gradient ÷ C: one example moves the sum by at most 1, and dp_noise given "
     "the loss as l2_clip draws σ·1 (the same ε as the unscaled run, whose update it is ÷ C)"),
  _R("TrainStep", "loss_fn=clipped_loss(..., has_aux=True), has_aux=True", KEPT,
     "each example's aux rides beside the same clipped sum, from the same forward pass (with "
     "axis_name the devices' rows joined); it is monitoring, not a private release"),
  _R("TrainStep", "skip_nonfinite=True", KEPT,
     "judges the clipped gradients only: a NaN loss value drops nothing"),
  _R("TrainStep", 'skip_nonfinite="window"', KEPT,
     "as accumulate's: clipped sums are finite, so no window is dropped; one that is not finite "
     "makes the noisy update of zero sums, counted, with or without axis_name"),
  _R("TrainStep", "weight_fn", REFUSED, "multiplies the clipped sums by a data-dependent weight",
     "weight_fn"),
  _R("TrainStep", "step(..., weight=...)", REFUSED, "multiplies the clipped sums", "weight"),
  _R("TrainStep", "noise_scale=True", REFUSED,
     "releases statistics of the un-noised clipped sums", "noise_scale"),
  _R("TrainStep", "step(..., force_emit=True)", KEPT,
     "a short window sums fewer clipped gradients; the same noise and divisor"),
  _R("TrainStep", "donate=True, grad_buffer=True", KEPT, "memory only"),
  _R("TrainStep", "the state saved right after an update (a window boundary)", MADE_RIGHT,
     "as accumulate's: the emitting program zeroes the spent clipped sums and window weight "
     "(with axis_name, and FSDP's per-device sums too)"),
  _R("TrainStep", 'axis_name="data", mesh', KEPT,
     "per-device clipped sums, one all-reduce per window, one noise draw after it"),
  _R("TrainStep", "inner=chain(<anything>, dp_noise(...), ...)", REFUSED,
     "what stands before the noise acts on the un-noised clipped sums", "noise_not_first"),
  _R("TrainStep", "loss_fn=clipped_loss(...), no dp_noise in inner", REFUSED,
     "half a mechanism: clipped sums applied with no noise at all", "half_clipped"),
  _R("TrainStep", "dp_noise in inner, loss_fn not clipped", REFUSED,
     "half a mechanism: noise scaled to C on gradients nothing bounds", "half_noise"),
  _R("TrainStep", "bfloat16 parameters", REFUSED,
     "clipped_loss's gradient has the parameters' dtype: each micro-step's clipped sum rounded "
     "before the noise", "narrow_sums"),
  _R("TrainStep", "Mechanism.train_step: a window that every_k closes, not force_emit", REFUSED,
     "a window is one Poisson batch: closed by every_k inside or across batches, it joins two "
     "batches' micro-batches in one update (an example sampled in both counts twice)",
     "window_not_batch"),
  _R("TrainStep", "step(..., force_emit=True), loss_fn with mask_argnum=None", REFUSED,
     "variable windows are a padded sampler's batches: padding rows would count as example 0",
     "unmasked_padding"),
  # microbatch(fun, k, ...)
  _R("microbatch", "fun=clipped_grad(...)", KEPT, _SUM),
  _R("microbatch", "fun=value_and_grad(clipped_loss(...))", KEPT, _SUM),
  _R("microbatch", "fun=clipped_grad(..., has_aux=True, return_values=True)", KEPT,
     "the per-example loss values and aux ride as \"concat\" rows beside the same clipped sum "
     "(from the same forward pass); they are monitoring, not a private release"),
  _R("microbatch", "fun=value_and_grad(clipped_loss(..., has_aux=True), has_aux=True)", KEPT,
     "the per-example aux rides as \"concat\" rows beside the same clipped sum: name the "
     "reduction, ((\"sum\", \"concat\"), \"sum\") (omitted, it raises naming it; the "
     "default would sum the rows)"),
  _R("microbatch", "fun=clipped_grad(..., rescale_to_unit_norm=True)", MADE_RIGHT,
     "each clipped gradient ÷ C: one example moves the sum by at most 1, and dp_noise given "
     "the function as l2_clip draws σ·1 (the same ε as the unscaled run, whose update it is ÷ C)"),
  _R("microbatch", "reduction omitted", MADE_RIGHT,
     'the function\'s own (ClippedGrad.reduction, else "sum"), not microbatch\'s "mean"'),
  _R("microbatch", 'reduction="sum"', KEPT, _SUM),
  _R("microbatch", 'reduction="mean"', REFUSED,
     "divides by the realised number of micro-batches (data-dependent)", "reduction_mean"),
  _R("microbatch", 'reduction="stack" / "last"', KEPT,
     "an example is in one micro-batch: its entry moves by at most C"),
  _R("microbatch", "num_real_microbatches", KEPT,
     "padded micro-batches are not run; the sum of the real ones is kept"),
  _R("microbatch", "num_real_microbatches, rows laid out for the other split", MADE_RIGHT,
     "real rows (the mask's) in micro-batches that do not run raise, naming split= on both "
     "(host values), or make the sums NaN (traced): never a clipped sum missing examples"),
  _R("microbatch", "weight_fn", REFUSED, "multiplies the clipped sums by a data-dependent weight",
     "weight_fn"),
  _R("microbatch", "skip_nonfinite", MADE_RIGHT,
     "nothing is dropped, whatever it says: a NaN loss value gives a NaN loss, never a lost "
     "micro-batch of clipped gradients"),
  _R("microbatch", "noise_scale", REFUSED, "releases statistics of the un-noised clipped sums",
     "noise_scale"),
  _R("microbatch", "state_argnums", REFUSED,
     "a state computed from the examples reaches the next micro-batches", "state_argnums"),
  _R("microbatch", "accum_dtype narrower than float32", REFUSED,
     "rounding the running sum breaks the C bound", "accum_dtype"),
  _R("microbatch", 'split="contiguous", microbatch_size', KEPT, "which rows go where only"),
  _R("microbatch", "batch_argnums", KEPT, "which arguments are split only"),
  _R("microbatch", "rng_argnums", KEPT, "keys folded per micro-batch; the sums are the same"),
  _R("microbatch", "return_info=True", KEPT,
     "the info (counts, total weight) is for monitoring, not a private release"),
  _R("microbatch", 'axis_name="data"', KEPT,
     "the devices' clipped sums meet in the one all-reduce after the loop"),
  _R("microbatch", "an argument with the batch's size not in batch_argnums", REFUSED,
     "passed whole to every micro-batch: each micro-batch's examples see all of it (also "
     "inside data_parallel, where it is the global batch)", "unsplit_argument"),
  _R("microbatch", "fun whose loss captures the whole batch (closure, partial)", REFUSED,
     "every micro-batch's examples see all of it (the logical batch's labels captured by the "
     "loss of a clipped_grad)", "captured_batch"),
  _R("microbatch", "num_real_microbatches, fun with mask_argnum=None", REFUSED,
     "a padded batch whose padding rows (copies of example 0) would count", "unmasked_padding"),
  _R("microbatch", "fun=clipped_grad(...), bfloat16 parameters", MADE_RIGHT,
     "the clipped sums stay float32 until the noise (dp_noise adds it in float32; apply_updates "
     "casts the noisy update to the parameters' dtype)"),
  # clipped_grad / clipped_loss themselves
  _R("clipped_grad", "an argument with the batch's size not in batch_argnums", REFUSED,
     "passed whole to every example (the labels of loss(params, x, y) with batch_argnums=1): "
     "one example's label reaches every per-example gradient", "unsplit_argument"),
  _R("clipped_grad", "a loss capturing an array with the batch's size (closure, partial)", REFUSED,
     "lambda p, x: loss(p, x, y) or functools.partial(loss, y=y): the labels reach every "
     "per-example gradient, as when left out of batch_argnums", "captured_batch"),
  _R("clipped_loss", "an argument with the batch's size not in batch_argnums", REFUSED,
     "as clipped_grad's (TrainStep, accumulate)", "unsplit_argument"),
  _R("clipped_loss", "differentiated for parameters narrower than float32", REFUSED,
     "its gradient has the parameters' dtype: each clipped sum rounded before the noise on every "
     "front end (microbatch, a hand loop), and a cast up afterwards cannot undo it",
     "narrow_sums"),
  _R("clipped_grad", "mask_argnum not given", REFUSED,
     "a padded batch (PoissonSampler's: copies of example 0) fed to a function without the mask "
     "counts every padding row as example 0 wherever nothing says the batch is padded "
     "(microbatch without num_real_microbatches; TrainStep or a hand-written accumulate loop "
     "with every_k=max_microbatches: 19·C from example 0, not sampled)", "mask_not_said"),
  _R("clipped_loss", "mask_argnum not given", REFUSED,
     "as clipped_grad's (TrainStep, a hand-written accumulate loop)", "mask_not_said"),
  _R("clipped_grad", "mask_argnum=None", KEPT,
     "batches declared without padding: every row is a real example, as declared"),
  _R("clipped_grad", "shared_argnums", KEPT,
     "an argument declared the same for every example: passed whole, as declared"),
  _R("clipped_grad", "a psum or pmean over the batch's axis in the loss (sync BatchNorm)",
     REFUSED, "each example's value depends on other devices' examples: one example reaches "
     "every device's per-example gradients", "batch_statistic"),
  _R("clipped_grad", "inside shard_map(check_vma=False) or pmap", REFUSED,
     "no device-variance types: a model shard's gradient clipped alone (√2·C per example)",
     "no_variance"),
  _R("PoissonSampler", "Mechanism: batch.take(x, y), the mask with the rows", KEPT,
     "the clipped function takes the mask after the batch arguments; padding counts 0"),
  # data_parallel(fun, axis_name, ...)
  _R("data_parallel", 'sync="update"', KEPT,
     "binds the axis; the front ends inside keep their contract"),
  _R("data_parallel", 'sync="microbatch"', KEPT,
     "GSPMD sums each micro-batch's clipped sums; the same sum"),
  _R("data_parallel", 'varying="concat"', KEPT,
     "joins per-device outputs; what it joins (ClipStats norms) is monitoring, not private"),
  # the noise and the accountant
  _R("dp_noise", "l2_clip=C for clipped_grad/clipped_loss(..., rescale_to_unit_norm=True)",
     REFUSED, "noise σ·C on a sum whose bound is 1: not the noise the accountant is told",
     "rescaled_clip"),
  _R("dp_noise", "inside shard_map(check_vma=False) or pmap", REFUSED,
     "no device-variance types: every model shard of a leaf would draw the same noise",
     "no_variance"),
  _R("dp_noise", "a key drawn from before in this process", REFUSED,
     "two runs on one key draw the same noise, whether or not the first is alive", "key_reused"),
  _R("dp_noise", "a traced key (built under jax.jit or jax.vmap)", REFUSED,
     "the registry cannot see a traced key's value: two jitted runs (or a sweep vmapped over "
     "keys) on one key would draw the same noise", "key_traced"),
  _R("dp_noise", "the state saved, dp_noise rebuilt with allow_key_reuse=True", MADE_RIGHT,
     "the state holds the update count only (the key stays with the transformation: a saved or "
     "shared state cannot regenerate the noise); rebuilt on the same key with the state "
     "restored, the stream continues at its count: the uninterrupted run's updates"),
  _R("dp_epsilon", 'neighboring_relation="replace_one"', KEPT,
     "one example replaced moves the update by at most 2C/B (sensitivity(\"replace_one\")); "
     "dp_noise draws σ·C as for add-or-remove, and the PLD accountant analyses the outputs' "
     "±C shift itself: the same σ, replace-one's ε"),
  _R("dp_epsilon", 'neighboring_relation="replace_one", accountant="rdp"', REFUSED,
     "dp-accounting's RDP has no Poisson-sampled replace-one analysis", "rdp_replace_one"),
  # layouts x front ends
  _R("layout", "one device", KEPT, "every row above is measured on one device"),
  _R("layout", 'shard_map over ("data",)', KEPT,
     "accumulate and microbatch with axis_name inside jax.shard_map, 8 devices"),
  _R("layout", 'plain jit, mesh ("data",)', KEPT,
     "TrainStep(axis_name), microbatch(axis_name, mesh) and data_parallel bind the axis"),
  _R("layout", 'shard_map over ("data", "model")', MADE_RIGHT,
     "the per-example norm is global (a model shard's squares summed over the model axis); a "
     "sharded leaf draws its own noise per model shard, a replicated one the same everywhere"),
  _R("layout", 'plain jit, mesh ("data", "model")', KEPT,
     "each leaf is one global array: norms and noise are global (Auto and Explicit axes)"),
  _R("layout", 'plain jit, FSDP: keep_unsharded="nothing" / "params" / "params_and_grads"',
     KEPT, "microbatch and TrainStep reduce-scatter the clipped sums instead of all-reducing "
     "them: the same sums, sharded like the parameters; the noise is drawn once per update on "
     "the global (sharded) arrays"),
))  # fmt: skip


def contract_table() -> str:
  """The privacy contract as a Markdown table (one row per `CONTRACT` row), as the privacy
  guide shows it.

  Returns:
    The table, a string.

  >>> from optax_accum import privacy
  >>> print(privacy.contract_table().splitlines()[0])
  | front end | option | verdict | on a private path |
  """
  lines = ["| front end | option | verdict | on a private path |", "|---|---|---|---|"]
  for row in CONTRACT:
    why = row.why
    if row.error is not None:
      why += f"; raises ValueError, fix: {fix(row)}"
    option = row.option.replace("|", "\\|")
    lines.append(f"| `{row.front}` | `{option}` | **{row.verdict}** | {why} |")
  return "\n".join(lines)


def fix(row: ContractRow) -> str | None:
  """The fix a refused row's error names (its last sentences, from "Use" or "Remove")."""
  if row.message is None:
    return None
  text = row.message
  at = max(text.rfind(". Use "), text.rfind(". Remove "))
  return text[at + 2 :] if at >= 0 else text
