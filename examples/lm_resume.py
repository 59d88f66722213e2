"""Train a byte-level language model with token-weighted gradient accumulation, checkpoint it
with Orbax, and resume it after a crash — in the middle of a window — to the bit.

    python examples/lm_resume.py --dir /tmp/lm_run    # trains; kill it at any moment
    python examples/lm_resume.py --dir /tmp/lm_run    # resumes from the last checkpoint

Every ``--every`` micro-steps an Orbax `CheckpointManager` saves, asynchronously, the
parameters, the `TrainStep` state (the open window's weighted sums and position included), the
grain iterator's position and this run's configuration. A resume under another configuration
refuses and says what to do. Ctrl-C stops the run after the current micro-step, with a checkpoint
there, and says where it will resume (Ctrl-C again: at once, from the latest finished one).
Public names only: `optax_accum.TrainStep`, `orbax.checkpoint`, `grain.MapDataset`. Needs
``pip install 'optax-accum[examples]'`` (orbax-checkpoint and grain included).
"""

import argparse
import os
import pathlib
import signal
import sys
import sysconfig

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum

FILES = ("functools.py", "argparse.py")  # the corpus: standard-library source, no download


def corpus(seq_len):
  """Paragraphs of `FILES` as NUL-padded byte rows, and the mask of their real targets."""
  root = sysconfig.get_paths()["stdlib"]
  text = b"".join(pathlib.Path(root, name).read_bytes() for name in FILES)
  docs = [d.strip(b"\n")[: seq_len + 1] for d in text.split(b"\n\n") if len(d.strip()) > 1]
  tokens = np.zeros((len(docs), seq_len + 1), np.int32)
  for i, d in enumerate(docs):
    tokens[i, : len(d)] = np.frombuffer(d, np.uint8)
  lengths = np.array([len(d) for d in docs])
  mask = (np.arange(seq_len) < lengths[:, None] - 1).astype(np.float32)
  return tokens, mask


def micro_batches(tokens, mask, rows, seed):
  """grain: a seeded shuffle, repeated for ever, in micro-batches of `rows` rows."""
  ds = grain.MapDataset.source(np.arange(len(tokens))).shuffle(seed=seed).repeat(None)
  ds = ds.map(lambda i: {"tokens": tokens[i], "mask": mask[i]})
  return iter(ds.batch(rows, drop_remainder=True))  # checkpointable: get_state / set_state


def init_params(seed, width, seq_len):
  keys = jax.random.split(jax.random.key(seed), 4)
  normal = lambda key, shape: jax.random.normal(key, shape) / np.sqrt(shape[0])  # noqa: E731
  return {
    "embed": normal(keys[0], (256, width)),
    "pos": jnp.zeros((seq_len, width)),
    "up": normal(keys[1], (width, 4 * width)),
    "down": normal(keys[2], (4 * width, width)),
    "head": normal(keys[3], (width, 256)),
  }


def loss(params, batch):
  """Mean next-byte cross-entropy over the batch's real tokens (a small causal model: each
  position sees its byte and the mean of the bytes before it)."""
  inputs = batch["tokens"][:, :-1]
  x = params["embed"][inputs] + params["pos"]
  x = x + jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
  x = x + jax.nn.gelu(x @ params["up"]) @ params["down"]
  ce = optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch["tokens"][:, 1:])
  return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


def real_tokens(batch):
  """A micro-batch's weight: its number of real tokens, the denominator of its loss."""
  return jnp.sum(batch["mask"])


def positive_int(text):
  """An argparse type: an int ≥ 1 (``argument --k: must be a positive int, got '0'``)."""
  if not text.strip().lstrip("+").isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
  return int(text)


def uint32(text):
  """An argparse type: an int in [0, 2**32), what `jax.random.key` and grain take."""
  if not text.strip().lstrip("+").isdigit() or int(text) >= 2**32:
    raise argparse.ArgumentTypeError(f"must be an int in [0, 2**32), got {text!r}")
  return int(text)


def refuse_other_config(saved, config):
  """Exits naming every setting that differs from the one the checkpoints were written with
  (``steps`` may differ: more steps extend the run)."""
  changed = [key for key in config if key != "steps" and saved.get(key) != config[key]]
  if changed:
    said = "; ".join(
      f"--{key} {saved[key]} in the checkpoints, {config[key]} now" for key in changed
    )
    again = " ".join(f"--{key} {saved[key]}" for key in changed)
    sys.exit(f"refusing to resume: {said}. Resume with {again}, or give a new --dir.")


class StopOnCtrlC:
  """Ctrl-C (SIGINT) sets `requested` instead of raising `KeyboardInterrupt` in the middle of a
  step or of an asynchronous save (whose threads would then fail at exit, hundreds of lines of
  tracebacks); the loop saves, closes the manager and stops. A second Ctrl-C exits at once:
  Orbax writes into a temporary directory, so a checkpoint cut short is never restored."""

  def __init__(self):
    self.requested = False
    signal.signal(signal.SIGINT, self.stop)

  def stop(self, signum, frame):
    if self.requested:
      print("interrupted again: exiting now", file=sys.stderr, flush=True)
      os._exit(130)
    self.requested = True
    print("interrupted: stopping after this micro-step", file=sys.stderr, flush=True)


def save_args(params, state, iterator, config):
  return ocp.args.Composite(
    params=ocp.args.StandardSave(params),
    state=ocp.args.StandardSave(state),
    data=ocp.args.JsonSave(iterator.get_state()),
    config=ocp.args.JsonSave(config),
  )


def restore(manager, params, state, iterator, config):
  """The latest checkpoint's parameters and state, with the iterator set to its position."""
  step = manager.latest_step()
  saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  refuse_other_config(saved["config"], config)
  abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract(params)),
      state=ocp.args.StandardRestore(abstract(state)),
      data=ocp.args.JsonRestore(),
    ),
  )
  iterator.set_state(restored["data"])
  return step, restored["params"], restored["state"]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", required=True, help="checkpoint directory (resumed if it has any)")
  p.add_argument("--k", type=positive_int, default=5, help="micro-batches per optimizer step")
  p.add_argument("--rows", type=positive_int, default=4, help="sequences per micro-batch")
  p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps")
  p.add_argument("--every", type=positive_int, default=4, help="micro-steps between checkpoints")
  p.add_argument("--seed", type=uint32, default=0)
  args = p.parse_args(argv)
  config = {"k": args.k, "rows": args.rows, "steps": args.steps, "seed": args.seed}
  config.update(lr=1e-2, seq_len=64, width=32, data="+".join(FILES))

  tokens, mask = corpus(config["seq_len"])
  iterator = micro_batches(tokens, mask, args.rows, args.seed)
  step = optax_accum.TrainStep(loss, optax.adam(config["lr"]), args.k, weight_fn=real_tokens)
  params = init_params(args.seed, config["width"], config["seq_len"])
  state = step.init(params)
  options = ocp.CheckpointManagerOptions(save_interval_steps=args.every, max_to_keep=2)
  manager = ocp.CheckpointManager(os.path.abspath(args.dir), options=options)
  done, total = 0, args.k * args.steps
  if manager.latest_step() is not None:
    done, params, state = restore(manager, params, state, iterator, config)
    print(f"resumed after micro-step {done}: window position {int(state.mini_step)}/{args.k}")
    if done > total:
      past = f"the checkpoints are at micro-step {done}, past --steps {args.steps} ({total})"
      sys.exit(f"refusing to resume: {past}. Give more --steps, or a new --dir.")
  ctrl_c = StopOnCtrlC()
  for n in range(done + 1, total + 1):
    params, state, value = step(params, state, next(iterator))
    stopping = ctrl_c.requested and n < total
    manager.save(n, args=save_args(params, state, iterator, config), force=n == total or stopping)
    print(f"micro-step {n}/{total}, loss {float(value):.4f}", flush=True)
    if stopping:
      manager.wait_until_finished()
      manager.close()
      at = f"micro-step {n}, window position {int(state.mini_step)}/{args.k}"
      print(f"interrupted: saved at {at}; run the same command to resume from there", flush=True)
      sys.exit(130)
  manager.wait_until_finished()
  manager.close()
  np.savez(os.path.join(args.dir, "final_params.npz"), **jax.device_get(params))
  print(f"done: {int(state.gradient_step)} optimizer steps; parameters in {args.dir}")


if __name__ == "__main__":
  main()
