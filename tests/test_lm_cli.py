"""The command line of ``python -m optax_accum.demo lm``: every flag checked by argparse with a
message naming it, and a checkpointed run that refuses to resume under another configuration."""

from __future__ import annotations

import os

import numpy as np
import pytest

from optax_accum import demo
from optax_accum.demo import digits
from optax_accum.demo.lm import cli, run_config


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--quick", "--k", "3"], "--batch-size must be a multiple of --k=3, got 4"),
    (["--steps", "0"], "argument --steps: must be a positive int, got '0'"),
    (["--k", "two"], "argument --k: must be a positive int, got 'two'"),
    (["--batch-size", "-4"], "argument --batch-size: must be a positive int, got '-4'"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be a positive int, got '0'"),
    (["--memory-budget-mib", "0"], "argument --memory-budget-mib: must be a positive finite"),
    (["--memory-budget-mib", "nan"], "must be a positive finite number, got 'nan'"),
    (["--memory-budget-mib", "inf"], "must be a positive finite number, got 'inf'"),
    (["--lr", "0"], "argument --lr: must be a positive finite number, got '0'"),
    (["--lr", "nan"], "argument --lr: must be a positive finite number, got 'nan'"),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 2**32), got '-1'"),
    (["--checkpoint-dir", ""], "--checkpoint-dir must name a directory, got ''"),
    (["--checkpoint-dir", "/proc/optax_accum"], "'/proc/optax_accum' is not a directory this"),
    (["--distributed"], "--distributed needs --checkpoint-dir"),
  ],
)
def test_lm_cli_bad_flags_name_the_flag(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(argv)
  assert e.value.code == 2
  assert match in capsys.readouterr().err


def test_lm_cli_directory_under_a_file_names_it(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  for flag in ("--checkpoint-dir", "--out"):
    with pytest.raises(SystemExit):
      cli.parse_args([flag, str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert f"{flag} '{tmp_path}/file/run' is not a directory this process can write to" in err


def test_lm_cli_out_with_checkpoint_dir_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit):
    cli.parse_args(["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path)])
  assert "--out is for the four-way run" in capsys.readouterr().err


def test_lm_cli_help_of_the_main_job_names_the_lm_task(capsys):
  with pytest.raises(SystemExit):
    digits.parse_args(["--help"])
  assert "python -m optax_accum.demo lm" in capsys.readouterr().out


def test_lm_run_config_mismatch_names_both_values_and_the_fix():
  saved = {"model": "quick", "k": 4, "batch_size": 8, "lr": 3e-3, "seed": 0, "processes": 1}
  assert run_config.mismatch(saved, dict(saved), "d") is None
  for key in run_config.KEYS:  # any one setting alone refuses
    said = run_config.mismatch({**saved, key: "saved"}, {**saved, key: "now"}, "d")
    assert said and "saved" in said and "now" in said, key
  now = dict(saved, model="full", k=2, processes=2)
  said = run_config.mismatch(saved, now, "d")
  assert said.startswith(
    "refusing to resume d: its checkpoints were written with --quick, this run has no --quick "
    "(the full model); --k 4, this run has --k 2; 1 process, this run has 2 processes. Run "
    "again with --quick, --k 4, 1 process to resume it"
  )
  assert run_config.past_the_end(12, 12, 4, "d") is None
  assert "Give --steps 3 or more" in run_config.past_the_end(9, 8, 4, "d")


@pytest.mark.slow
def test_lm_cli_resume_under_another_configuration_refuses(tmp_path, capsys):
  base = ["lm", "--quick", "--no-progress", "--checkpoint-dir", str(tmp_path)]
  base += ["--batch-size", "32", "--checkpoint-every", "2"]  # k=2 and 4 on 8 devices
  demo.main([*base, "--k", "2", "--steps", "2"])
  first = capsys.readouterr().out
  assert "micro-step 2/4 window position 2/2" in first  # the closed window reads 2/2, not 0/2
  final = dict(np.load(tmp_path / "final_params_0.npz"))
  # Each refusal sets up the run (model, train step, mesh) before it reads the checkpoints: one
  # run differing in three settings (each refuses alone: `mismatch` checks every setting, see
  # test_lm_run_config_mismatch_names_both_values_and_the_fix), one past the end.
  full = ["lm", "--no-progress", "--checkpoint-dir", str(tmp_path), "--batch-size", "32"]
  cases = [
    (
      [*full, "--k", "4", "--steps", "2", "--seed", "1"],
      [
        "its checkpoints were written with --quick, this run has no --quick (the full model)",
        "; --k 2, this run has --k 4;",
        "; --seed 0, this run has --seed 1",
      ],
    ),
    (
      [*base, "--k", "2", "--steps", "1"],
      ["latest checkpoint is at micro-step 4, past this run's last"],
    ),
  ]
  for argv, said in cases:
    with pytest.raises(SystemExit) as e:
      demo.main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    assert all(s in out.err for s in said) and "micro-step 1/" not in out.out, out
  # Refusals restored nothing and wrote nothing: the saved run is intact.
  np.testing.assert_array_equal(
    np.load(tmp_path / "final_params_0.npz")["['head']['kernel']"], final["['head']['kernel']"]
  )
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
