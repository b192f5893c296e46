"""grain and tokamax read their absl flags; the host's command line and parse state stay its own."""

import subprocess

from multidevice import run_program


def _run(program: str, *args: str) -> subprocess.CompletedProcess:
  return run_program(program, *args, timeout=180, check=False)


def test_tokamax_runs_under_a_foreign_command_line():
  result = _run("tokamax_under_a_foreign_command_line", "--model.num_layers", "2", "-q")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "(1, 8, 2, 8)" in result.stdout


def test_tokamax_still_reads_its_own_flag_from_the_command_line():
  result = _run("tokamax_flag_from_the_command_line", "-q",
                "--tokamax_autotuning_cache_miss_fallback=error")
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["error"]


def test_grain_workers_start_and_the_parse_state_is_left_alone():
  # Nothing parsed: the host (a notebook, a script) may still parse its own flags later.
  result = _run("grain_workers_leave_flags_unparsed")
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == ["(4, 16) False", "True"]
