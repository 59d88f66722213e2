"""`python -m optax_accum.demo dp`: the DP task end to end (an integration test)."""

import re

import pytest

import optax_accum as oa
from optax_accum import demo


@pytest.mark.slow  # the DP task end to end: an integration test
def test_dp_demo_quick_accounts_updates_and_learns(capsys):
  out = demo.main(["dp", "--quick", "--epsilon", "3.0"])
  captured = capsys.readouterr()
  printed = captured.out
  # Progress on stderr: the set-up phases, then a bar per run, each "compiling …" at first.
  for shown in ("calibrating σ", "private", "non-private", "40/40", "compiling …"):
    assert shown in captured.err, (shown, captured.err[-2000:])
  assert out["updates"] == 40  # --quick: 40 noisy updates, each a Poisson batch
  assert out["micro_steps"] > 4 * out["updates"]  # a logical batch is many micro-steps
  q = 256 / 1438
  assert out["epsilon"] == oa.privacy.dp_epsilon(40, q, out["sigma"], 1e-5)
  assert 2.9 < out["epsilon"] <= 3.0  # σ was calibrated for the target
  assert out["private_accuracy"] > 0.5 and out["plain_accuracy"] > 0.8  # chance is 0.1
  assert "ε = " in printed and "non-private: test accuracy" in printed


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--micro", "0"], r"argument --micro: must be a positive int, got '0'"),
    (["--epsilon", "-1"], r"argument --epsilon: must be a positive finite number, got '-1'"),
    (["--epsilon", "0"], r"argument --epsilon: must be a positive finite number, got '0'"),
    (["--epsilon", "inf"], r"argument --epsilon: must be a positive finite number, got 'inf'"),
    (["--delta", "1.5"], r"argument --delta: must be in \(0, 1\), got '1.5'"),
    (["--clip", "inf"], r"argument --clip: must be a positive finite number, got 'inf'"),
    (["--clip", "nan"], r"argument --clip: must be a positive finite number, got 'nan'"),
    (["--lr", "inf"], r"argument --lr: must be a positive finite number, got 'inf'"),
    (["--lr=-1e-3"], r"argument --lr: must be a positive finite number, got '-1e-3'"),
    (
      ["--batch-size", "5000"],
      r"--batch-size must be at most the 1438 training examples, got 5000",
    ),
    (["--updates", "0"], r"argument --updates: must be a positive int, got '0'"),
  ],
)
def test_dp_demo_bad_flags_name_the_flag(argv, match, capsys, monkeypatch):
  # Refused by argparse before any data is loaded or any step compiled.
  from optax_accum.demo import digits

  def no_training(*args, **kwargs):
    raise AssertionError("the flags should have been refused before the data was loaded")

  monkeypatch.setattr(digits, "load_digits", no_training)
  with pytest.raises(SystemExit) as exit:
    demo.main(["dp", *argv])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert re.search(match, err), err
  assert err.startswith("usage: python -m optax_accum.demo dp")


def test_dp_demo_flag_checks_use_the_digits_training_size():
  pytest.importorskip("sklearn")
  from optax_accum.demo import digits

  (x, _), _ = digits.load_digits()
  assert len(x) == digits.TRAIN_EXAMPLES == 1438
