"""Builds notebooks/tour.ipynb from the cells below and executes it, outputs included.

    python notebooks/build_tour.py            # write and execute notebooks/tour.ipynb
    python notebooks/build_tour.py --no-run   # write it without outputs

The notebook is committed with its outputs; tests/test_notebooks.py re-executes it in CI.
Edit the cells here, not in the .ipynb, so the two never drift.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOK = HERE / "tour.ipynb"

CELLS: list[tuple[str, str]] = [
  (
    "md",
    """# Gradient accumulation in JAX with `optax_accum`: a tour

**Running this notebook.** From a clone of the repository (there is no release on PyPI yet):

```bash
pip install -e ".[examples]" jupyterlab
jupyter lab notebooks/tour.ipynb
```

The `examples` extra holds what the cells import (flax, scikit-learn, matplotlib); the `docs`
extra adds a Jupyter kernel (ipykernel) but no Jupyter front end, so add `jupyterlab` (or open
the file in any editor that runs notebooks). It runs on a CPU in about two minutes.""",
  ),
  (
    "md",
    """You have a loss, a model and an optax optimizer, and you want to train with a batch of
`k·b` examples on a device that only holds `b` at a time. `optax_accum` gives you the
update of the large batch — exactly, up to float32 rounding — with the memory of one
micro-batch, in one of two forms:

1. **`accumulate(inner, every_k)`** — across steps: an optax transformation. Feed it one
   micro-batch gradient per training step; every `k`-th step it applies `inner` to the
   (weighted) mean of the window.
2. **`microbatch(fun, k)`** — within one step: a function transform that runs `fun`
   (typically `jax.value_and_grad(loss)`) on `k` slices of the batch under one `lax.scan`.

This notebook trains a small MLP on scikit-learn's handwritten digits (they ship with the
package: no download), checks both forms and the fast path `TrainStep` against the large
batch, shows why token counts must weight the average, measures the memory/speed trade-off,
and lets `plan_microbatches` choose `k` for a memory budget.""",
  ),
  (
    "code",
    """import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits

import optax_accum

x_all, y_all = load_digits(return_X_y=True)
x_all = (x_all / 16.0).astype(np.float32)
y_all = y_all.astype(np.int32)
n_classes = len(np.unique(y_all))
print(f"{len(x_all)} images of 8x8 pixels, {n_classes} classes")
print(f"jax {jax.__version__}, optax {optax.__version__}")""",
  ),
  (
    "md",
    """## The model, and why a large batch costs memory

A two-layer MLP in plain JAX. The memory a training step needs beyond its parameters —
activations and their gradients — grows linearly with the batch. XLA tells us how much
before anything runs: `jax.jit(f).lower(...).compile().memory_analysis()`.""",
  ),
  (
    "code",
    """def init(key, sizes=(64, 512, 512, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


params0 = init(jax.random.key(0))
grad_fn = jax.value_and_grad(loss_fn)


def temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


sizes = [64, 128, 256, 512, 1024]
temps = [temp_bytes(grad_fn, params0, x_all[:n], y_all[:n]) for n in sizes]
plt.figure(figsize=(5, 3.2))
plt.plot(sizes, np.array(temps) / 2**20, "o-")
plt.xlabel("batch size (examples)")
plt.ylabel("temporary memory (MiB)")
plt.title("One gradient step: memory grows with the batch")
plt.grid(alpha=0.3)
plt.show()""",
  ),
  (
    "md",
    """## Form 1: `accumulate` — one micro-batch per training step

Wrap the optimizer. Each `update` adds one micro-batch gradient to sums kept in the optimizer
state; the `k`-th call hands their mean to Adam and returns Adam's update; the other calls
return zeros (and Adam does not run). The training loop does not change.

We train both ways on the same data: 30 optimizer steps of 256 examples, and, with
`accumulate`, 4 micro-batches of 64 per optimizer step (micro-batch `i` takes rows
`i, i+4, i+8, …`).""",
  ),
  (
    "code",
    """K, BATCH, STEPS = 4, 256, 30
rng = np.random.default_rng(0)
batches = [rng.choice(len(x_all), BATCH, replace=False) for _ in range(STEPS)]


def make_step(tx, grad_fn):
    @jax.jit
    def step(params, state, x, y):
        loss, grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
    return step


# The reference: one large batch per step.
tx = optax.adam(1e-3)
step = make_step(tx, grad_fn)
params, state, large_losses = params0, tx.init(params0), []
for idx in batches:
    params, state, loss = step(params, state, x_all[idx], y_all[idx])
    large_losses.append(float(loss))
params_large = params

# accumulate: K micro-steps per optimizer step.
tx = optax_accum.accumulate(optax.adam(1e-3), every_k=K)
step = make_step(tx, grad_fn)
params, state, acc_losses = params0, tx.init(params0), []
for idx in batches:
    window = []
    for i in range(K):
        x, y = x_all[idx[i::K]], y_all[idx[i::K]]
        params, state, loss = step(params, state, x, y)
        window.append(float(loss))
    acc_losses.append(np.mean(window))
params_acc = params


def max_diff(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(jnp.abs(u - v).max()) for u, v in pairs)


# Adam divides by sqrt(v), which amplifies float32 rounding over 30 steps:
# the tolerance is 1e-5, not 1e-6.
TOL = 1e-5
diff = max_diff(params_acc, params_large)
print(f"optimizer steps taken by accumulate: {int(state.gradient_step)}")
print(f"max |param difference| vs the large batch: {diff:.2e}")
assert diff < TOL""",
  ),
  (
    "md",
    """## Form 2: `microbatch` — the whole batch in one step, k slices inside

When the batch arrives in one piece, split it inside the step. `microbatch` returns a function
with `grad_fn`'s signature; it runs the 4 micro-batches under one `lax.scan` and averages the
loss and the gradients. One jitted call is one optimizer step.""",
  ),
  (
    "code",
    """mb_grad_fn = optax_accum.microbatch(grad_fn, K, batch_argnums=(1, 2))
tx = optax.adam(1e-3)
step = make_step(tx, mb_grad_fn)
params, state, mb_losses = params0, tx.init(params0), []
for idx in batches:
    params, state, loss = step(params, state, x_all[idx], y_all[idx])
    mb_losses.append(float(loss))
params_mb = params
diff = max_diff(params_mb, params_large)
print(f"max |param difference| vs the large batch: {diff:.2e}")
assert diff < TOL

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(large_losses, lw=4, alpha=0.4, label="large batch (256)")
ax.plot(acc_losses, "--", label=f"accumulate ({K} x {BATCH // K})")
ax.plot(mb_losses, ":", lw=2, label=f"microbatch ({K} x {BATCH // K})")
ax.set(xlabel="optimizer step", ylabel="training loss")
ax.set_title("Three ways, one curve")
ax.grid(alpha=0.3)
ax.legend()
plt.show()""",
  ),
  (
    "md",
    """## The fast path: `TrainStep`

`accumulate`'s `update` decides on the device whether a window closes: a `lax.cond` on the
state's counter, which skips the inner optimizer on the other calls. On a GPU, XLA runs a
conditional by copying its predicate to the host and waiting for it (unless the conditional is
captured in a CUDA graph), on every call, which stalls JAX's asynchronous dispatch. With an
integer `k` the host already knows which call closes a window, so `TrainStep` keeps that count
on the host and compiles **two programs**: an
accumulating one (gradient, then add it to the sums) and an emitting one (gradient, add, inner
update, apply to the parameters). Each call runs the right one, chosen in Python: no device
conditional, no host synchronisation, no zero updates built, and parameters and optimizer
state donated so nothing is copied. Its state is the same `AccumulateState`.""",
  ),
  (
    "code",
    """step = optax_accum.TrainStep(loss_fn, optax.adam(1e-3), every_k=K)
params = jax.tree.map(jnp.copy, params0)  # the step donates what it is given
state = step.init(params)
for idx in batches:
    for i in range(K):
        x, y = x_all[idx[i::K]], y_all[idx[i::K]]
        params, state, loss = step(params, state, x, y)
params_ts = params
print(f"optimizer steps: {int(state.gradient_step)}")
diff = max_diff(params_ts, params_large)
print(f"max |param difference| vs the large batch: {diff:.2e}")
assert diff < TOL""",
  ),
  (
    "md",
    """## How large a batch? The gradient noise scale

Accumulation computes gradients at two batch sizes anyway — each micro-batch is a small batch,
each window a large one — and that is all the *gradient noise scale*
`B_simple = tr Σ / |G|²` (McCandlish et al., 2018) needs: the batch size past which a larger
batch buys almost no fewer optimizer steps. `TrainStep(..., noise_scale=True)` (or
`accumulate(..., noise_scale=True)`) keeps a few scalars in the state; each closed window gives
an unbiased estimate of the trace `T` and of `|G|²` (`Q`), and `optax_accum.noise_scale(state)`
reports `b_simple` from exponential moving averages of the two, taken separately (the ratio of
the averages: one window's `T / Q` with `k = 4` is very noisy). Its unit is the micro-batch
weight: here weight 1 per micro-batch, so `B_simple` counts micro-batches of 64 examples
(pass token counts as weights and it counts tokens).

We train the same MLP longer, 120 optimizer steps of 4 × 64, and read it after each step.""",
  ),
  (
    "code",
    """step = optax_accum.TrainStep(loss_fn, optax.adam(1e-3), every_k=K, noise_scale=True)
params = jax.tree.map(jnp.copy, params0)
state = step.init(params)
read_noise = jax.jit(optax_accum.noise_scale)  # a few scalar operations, compiled once
rng = np.random.default_rng(1)
noise_losses, history = [], []
for _ in range(120):  # optimizer steps of K micro-batches of 64
    idx = rng.choice(len(x_all), BATCH, replace=False)
    window = []
    for i in range(K):
        params, state, loss = step(params, state, x_all[idx[i::K]], y_all[idx[i::K]])
        window.append(loss)
    noise_losses.append(float(np.mean(jax.device_get(window))))
    history.append(jax.device_get(read_noise(state)))
b_simple = np.array([h.b_simple for h in history])
one_window = np.array([h.window_trace_cov / h.window_grad_sq for h in history])

fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
a1.plot(noise_losses)
a1.set(yscale="log", xlabel="optimizer step", ylabel="training loss")
a1.set_title("The loss falls ...")
a2.plot(one_window, ".", color="0.6", ms=4, label="one window: T / Q")
a2.plot(b_simple, lw=2, label="B_simple (EMAs of T and Q)")
a2.axhline(K, ls=":", color="C3", label=f"the batch: {K} micro-batches")
a2.set(xlabel="optimizer step", ylabel=f"micro-batches (of {BATCH // K} examples)")
a2.set_ylim(-1, 3 * np.nanmax(b_simple))
a2.set_title("... and the noise scale B_simple grows")
for a in (a1, a2):
    a.grid(alpha=0.3)
a2.legend(fontsize=8)
fig.tight_layout()
plt.show()
last = float(b_simple[-1])
examples = last * BATCH / K
print(f"B_simple after {len(history)} steps: {last:.1f} micro-batches = {examples:.0f} examples")
print(f"(started at {b_simple[0]:.2f} micro-batches; the batch holds {K})")""",
  ),
  (
    "md",
    """**How to read it.** Early on the gradient is large against the noise of one micro-batch and
`B_simple` is small: a small batch already points the right way. As the loss falls, the true
gradient `|G|²` shrinks faster than the per-example noise `tr Σ`, so `B_simple` grows: the
critical batch rises during training. While it is below the batch you train with (the dotted
line), the larger batch wastes examples; once it is well above it, a larger `k` would still buy
fewer steps — the usual batch-size ramp, which `FollowNoiseScale` can follow for you. The
smoothed curve is the one to read; the scattered dots are single windows.""",
  ),
  (
    "md",
    """## Token weighting: the mean-of-means pitfall

With padded sequences the loss is a mean over *real* tokens. Averaging the micro-batches'
means gives every micro-batch the same say, however many real tokens it holds — so the
result is not the large batch's token mean. (Several frameworks did this for years.)

A toy "language model": one linear layer scoring each token, a padding mask, two
micro-batches of 4 sequences, one nearly full and one mostly padding.""",
  ),
  (
    "code",
    """key = jax.random.key(1)
kx, ky, kw = jax.random.split(key, 3)
# 8 sequences of 16 tokens, 4 features each
tokens = jax.random.normal(kx, (8, 16, 4))
targets = jax.random.normal(ky, (8, 16))
lengths = jnp.array([16, 15, 16, 14, 2, 3, 1, 2])  # real tokens per sequence
mask = (jnp.arange(16) < lengths[:, None]).astype(jnp.float32)
batch = {"x": tokens, "y": targets, "mask": mask}
w = jax.random.normal(kw, (4,))


def token_loss(w, batch):
    err = (batch["x"] @ w - batch["y"]) ** 2
    # the mean over real tokens
    return (err * batch["mask"]).sum() / batch["mask"].sum()


full_loss, full_grad = jax.value_and_grad(token_loss)(w, batch)
halves = [
    jax.tree.map(lambda a: a[:4], batch),
    jax.tree.map(lambda a: a[4:], batch),
]
micro = [jax.value_and_grad(token_loss)(w, h) for h in halves]
counts = [float(h["mask"].sum()) for h in halves]
for i, ((l, _), n) in enumerate(zip(micro, counts)):
    print(f"micro-batch {i}: {n:4.0f} real tokens, mean loss {float(l):.4f}")
mean_of_means = np.mean([float(l) for l, _ in micro])
weighted = sum(n * float(l) for (l, _), n in zip(micro, counts)) / sum(counts)
print(f"large batch token mean      {float(full_loss):.4f}")
print(f"mean of micro-batch means   {mean_of_means:.4f}   <- wrong")
print(f"token-weighted mean         {weighted:.4f}   <- the large batch's")""",
  ),
  (
    "md",
    """Both forms take the weight: `accumulate`'s `update(..., weight=n_real_tokens)` and
`microbatch`'s `weight_fn`, which is called like the function on each micro-batch. The
emitted gradient is `Σ wᵢ gᵢ / Σ wᵢ`: the large batch's, exactly.""",
  ),
  (
    "code",
    """# accumulate with weights: one update per micro-batch;
# SGD(1), so the update is minus the gradient.
tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
state = tx.init(w)
for h in halves:
    g = jax.grad(token_loss)(w, h)
    update, state = tx.update(g, state, w, weight=h["mask"].sum())

# microbatch with weight_fn (contiguous split: the same two halves as above).
token_grad = jax.value_and_grad(token_loss)
mb = optax_accum.microbatch(
    token_grad,
    2,
    weight_fn=lambda w, b: b["mask"].sum(),
    split="contiguous",
)
mb_loss, mb_grad = mb(w, batch)
unweighted = optax_accum.microbatch(token_grad, 2, split="contiguous")
uw_loss, uw_grad = unweighted(w, batch)

print("gradient error vs the large batch (max |Δ|):")
for name, grad in [
    ("accumulate, weight=tokens", -update),
    ("microbatch, weight_fn", mb_grad),
    ("microbatch, unweighted", uw_grad),
]:
    print(f"  {name:<26}  {float(jnp.abs(grad - full_grad).max()):.1e}")
assert jnp.allclose(-update, full_grad, rtol=1e-5, atol=1e-6)
assert jnp.allclose(mb_grad, full_grad, rtol=1e-5, atol=1e-6)""",
  ),
  (
    "md",
    """## The trade-off: memory against speed

More micro-batches mean less temporary memory (activations are kept for one micro-batch at a
time) but smaller matrix multiplies, which use the hardware less well, and one loop iteration
each. Below: one `microbatch` step with a batch of 1024, for `k` = 1 … 256, its compiled
temporary memory (XLA's analysis: exact, no run needed) and its measured time on this machine's
CPU (best of 7 runs; on a busy shared CPU the timings are noisy — read the trend).""",
  ),
  (
    "code",
    """xb, yb = x_all[:1024], y_all[:1024]
ks, temp_mib, step_ms = [1, 4, 16, 64, 256], [], []
for k in ks:
    f = jax.jit(optax_accum.microbatch(grad_fn, k, batch_argnums=(1, 2)))
    compiled = f.lower(params0, xb, yb).compile()
    temp_mib.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
    jax.block_until_ready(compiled(params0, xb, yb))
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params0, xb, yb))
        times.append(time.perf_counter() - t0)
    step_ms.append(1e3 * min(times))

fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
a1.plot(ks, temp_mib, "o-")
a1.set(xscale="log", xlabel="micro-batches k (batch 1024)")
a1.set(ylabel="temporary memory (MiB)")
a1.set_title("Temporary memory: activations / k")
a1.set_xticks(ks, [str(k) for k in ks])
a2.plot(ks, step_ms, "s-", color="C1")
a2.set(xscale="log", xlabel="micro-batches k (batch 1024)")
a2.set(ylabel="time per step (ms, best of 7)")
a2.set_title("Time per step on this CPU")
a2.set_xticks(ks, [str(k) for k in ks])
for a in (a1, a2):
    a.grid(alpha=0.3)
fig.tight_layout()
plt.show()
for k, m, t in zip(ks, temp_mib, step_ms):
    b = 1024 // k
    print(f"k={k:>3} (micro-batch {b:>4}): {m:6.2f} MiB, {t:6.2f} ms/step")""",
  ),
  (
    "md",
    """## Choosing `k`: `plan_microbatches`

Pick the smallest `k` whose step fits your memory: `plan_microbatches` compiles (never runs)
`microbatch(fun, k)` for divisors `k` of the batch and reads each program's peak —
arguments + outputs + temporaries − donated — from XLA's memory analysis, as above. It takes
shapes, so the batch need not exist. Here: a budget of 5 MiB for a step on 1024 examples.""",
  ),
  (
    "code",
    """shape = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
plan = optax_accum.plan_microbatches(
    grad_fn,
    jax.tree.map(shape, params0),
    shape(xb),
    shape(yb),
    batch_argnums=(1, 2),
    memory_limit=5 * 2**20,
)
print(plan)
k = plan.num_microbatches
planned = jax.jit(optax_accum.microbatch(grad_fn, k, batch_argnums=(1, 2)))
value, grads = planned(params0, xb, yb)
ref_value, ref_grads = grad_fn(params0, xb, yb)  # the large batch, directly
diff = max_diff(grads, ref_grads)
print(f"k={k}: loss {float(value):.6f} (large batch {float(ref_value):.6f})")
print(f"max |gradient difference| {diff:.1e}")
assert diff < 1e-6 and abs(float(value - ref_value)) < 1e-6""",
  ),
  (
    "md",
    """## What to take away

* `accumulate(inner, k)` for loops that see one micro-batch per step; `microbatch(fun, k)`
  when the batch arrives whole. Both give the large batch's update.
* Pass token counts as weights (`weight=`, `weight_fn=`) whenever micro-batches hold
  different numbers of real examples; the mean of means is a different, biased, average.
* The activations' memory falls as `1/k`, down to a floor (the gradients, the weights'
  working copies); speed drops once micro-batches are too small to keep the hardware busy.
  Use the largest micro-batch that fits.
* `TrainStep` is the fastest way to accumulate across steps: two compiled programs chosen on
  the host, no device conditional.
* `noise_scale=True` measures the gradient noise scale `B_simple` for free from the
  micro-batches: it grows as the loss falls, and tells you when a larger batch would pay off.
* BatchNorm sees micro-batch statistics under either form (the documentation's Flax guide
  shows both): that is the one place where accumulation is *not* the large batch.""",
  ),
]


def build() -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  for kind, src in CELLS:
    cell = nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
    nb.cells.append(cell)
  return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
  client = NotebookClient(
    nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
  )
  client.execute()
  return nb


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--no-run", action="store_true", help="write the notebook without executing it")
  args = p.parse_args()
  nb = build()
  if not args.no_run:
    start = time.perf_counter()
    execute(nb)
    print(f"executed in {time.perf_counter() - start:.1f} s")
  nbformat.write(nb, NOTEBOOK)
  print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
  main()
