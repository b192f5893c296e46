"""Native (C++) log lines kept off the console like the Python libraries' ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jax_ai_stack import logs, native_logs
from multidevice import run_program
from training_helpers import TINY

WARNING = b"W1125 21:40:17.123456   4242 spmd_partitioner.cc:652] Involuntary full rematerialization"


def test_which_lines_are_kept_aside():
  assert native_logs.kept(WARNING, after_kept=False)
  assert native_logs.kept(b"I0000 00:00:1795643433.662123   30205 gcs_file_system.cc:898] GCS",
                          after_kept=False)
  assert native_logs.kept(native_logs.ABSL_PREAMBLE + b" are written to STDERR", after_kept=False)
  assert not native_logs.kept(b"E1125 21:40:17.123456   4242 foo.cc:1] an error", after_kept=False)
  assert not native_logs.kept(b"F1125 21:40:17.123456   4242 foo.cc:1] Check failed", False)
  assert native_logs.kept(b"  continued", after_kept=True)
  assert not native_logs.kept(b"  continued", after_kept=False)
  for line in (b"Traceback (most recent call last):", b"step 3/10", b"Error: no", b"I think"):
    assert not native_logs.kept(line, after_kept=False)


def _run(tmp_path, mode):
  log = tmp_path / "jax-ai-stack.log"
  done = run_program("native_log_lines", log, mode, WARNING.decode(), text=False, check=True)
  return done.stderr.decode(), log.read_text() if log.exists() else ""


def test_native_info_and_warnings_go_to_the_log_file_and_the_rest_to_the_console(tmp_path):
  console, logged = _run(tmp_path, "on")
  assert "Involuntary" not in console and "device count" not in console
  assert "E1125 21:40:17.123456   4242 foo.cc:1] an error\n" in console  # Errors show.
  assert "\rstep 1/2\nours\n" in console  # Ours, and a bar's partial line, unchanged.
  assert console.rstrip().endswith(
      f"note: 1 library warnings (native.spmd_partitioner 1) kept off the console, in "
      f"{tmp_path / 'jax-ai-stack.log'}; --verbose shows them")
  assert f"WARNING native.spmd_partitioner: {WARNING.decode()}\n  its second line\n" in logged
  assert "INFO native.pjrt_client: I1125 21:40:17.123456   4242 pjrt_client.cc:579]" in logged
  assert "an error" not in logged


def test_off_it_changes_nothing(tmp_path):
  console, logged = _run(tmp_path, "off")
  assert "Involuntary full rematerialization\n  its second line\n" in console
  assert "device count" in console and not logged


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_xlas_own_lines_follow_the_rule_through_the_command_line(tmp_path, verbose):
  """TF_CPP_MIN_LOG_LEVEL=0 makes XLA log its devices at INFO from C++."""
  command = [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", "--workdir",
             str(tmp_path), *TINY, "train.steps=1", "train.eval_every=0", "train.sample_tokens=0",
             *(["--verbose"] if verbose else [])]
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0")
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  assert done.returncode == 0, done.stderr
  assert ("pjrt_client.cc" in done.stderr) == verbose
  if not verbose:
    assert "pjrt_client.cc" in (tmp_path / logs.LOG_FILE).read_text()
