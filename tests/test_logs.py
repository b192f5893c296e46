"""Tests for jax_ai_stack.logs and its use by the command line."""

import io
import logging
import subprocess
import sys

from jax_ai_stack import cli, logs


def test_library_warnings_go_to_the_file_ours_to_the_console(tmp_path):
  console = io.StringIO()
  path = logs.log_path(tmp_path / "run")
  with logs.routed(path, verbose=False, stream=console) as routes:
    for _ in range(3):
      logging.getLogger("absl").warning("Autotuning cache miss for %s", "op")
    logging.getLogger("orbax").info("saved")
    logging.getLogger("jax_ai_stack.recipes.train").warning("config x changed")
    logging.getLogger("jax_ai_stack.recipes.train").info("attention: chosen")
    logging.getLogger("grain").error("worker failed")
  assert console.getvalue().splitlines() == ["config x changed", "grain: worker failed"]
  kept = path.read_text()
  assert kept.count("Autotuning cache miss for op") == 3
  assert "saved" in kept and "attention: chosen" in kept
  assert routes.hidden == 3  # Library warnings, not their info.
  assert routes.summary() == (f"note: 3 library warnings (absl 3) kept off the console, in "
                              f"{path}; --verbose shows them")


def test_verbose_shows_everything_and_logging_is_restored_after(tmp_path):
  root = logging.getLogger()
  handlers, level = root.handlers[:], root.level
  console = io.StringIO()
  with logs.routed(None, verbose=True, stream=console) as routes:
    logging.getLogger("absl").warning("cache miss")
    logging.getLogger("jax_ai_stack").info("chosen")
  assert console.getvalue().splitlines() == ["absl: cache miss", "chosen"]
  assert routes.summary() is None and routes.path is None
  assert root.handlers == handlers and root.level == level


def test_an_unwritable_log_file_is_turned_off_quietly(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with logs.routed(blocker / "run" / logs.LOG_FILE, verbose=False) as routes:
    logging.getLogger("absl").warning("cache miss")
  assert routes.path is None
  assert "not kept" in routes.summary()
  assert "Traceback" not in capsys.readouterr().err


def test_each_process_has_its_own_log_file(tmp_path):
  assert logs.log_path(tmp_path) == tmp_path / "jax-ai-stack.log"
  assert logs.log_path(tmp_path, 3) == tmp_path / "jax-ai-stack.process-3.log"


def test_train_keeps_library_warnings_in_the_workdir_log(tmp_path, monkeypatch, capsys):
  from jax_ai_stack.recipes import train

  def noisy_run(config, workdir, *, on_open, **kwargs):
    del config, kwargs
    on_open()  # The run opened: its log goes to the workdir from here.
    for _ in range(5):
      logging.getLogger("absl").warning("Autotuning cache miss for attention")
    return {"step": 1, "stopped_by": None, "workdir": workdir}

  monkeypatch.setattr(train, "run", noisy_run)
  workdir = tmp_path / "run"
  assert cli.main(["train", "--workdir", str(workdir), "train.compile_cache=off"]) == 0
  err = capsys.readouterr().err
  assert "Autotuning" not in err
  assert err.strip().splitlines()[-1] == (
      f"note: 5 library warnings (absl 5) kept off the console, in {workdir / logs.LOG_FILE}; "
      "--verbose shows them")
  assert (workdir / logs.LOG_FILE).read_text().count("Autotuning cache miss") == 5


def test_ctrl_c_outside_the_training_loop_is_one_line_and_exit_130(tmp_path, monkeypatch,
                                                                   capsys):
  from jax_ai_stack.recipes import train

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(train, "run", interrupted)
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", "train.compile_cache=off"]) == 130
  assert capsys.readouterr().err.strip() == "jax-ai-stack train: interrupted (Ctrl-C)"


def test_held_records_reach_the_file_only_once_released(tmp_path):
  released, dropped = tmp_path / "released" / logs.LOG_FILE, tmp_path / "dropped" / logs.LOG_FILE
  for path, release in ((released, True), (dropped, False)):
    with logs.routed(None, verbose=False, stream=io.StringIO()) as routes:
      routes.keep_in(path, held=True)
      logging.getLogger("orbax").info("before the run opened")
      assert not path.exists() and routes.path is None
      if release:
        routes.release()
        logging.getLogger("orbax").info("after")
  assert released.read_text().count("before the run opened") == 1 and "after" in released.read_text()
  assert not dropped.parent.exists()  # A command that failed early wrote nothing there.


def test_a_note_is_a_line_of_its_own_after_what_stdout_already_holds():
  """stdout into a pipe is block-buffered: without the flush, the note would come first."""
  program = ("from jax_ai_stack import logs\n"
             "print('result'); logs.note('the run kept no held-out split'); print('more')")
  out = subprocess.run([sys.executable, "-c", program], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, check=True).stdout
  assert out.splitlines() == ["result", "note: the run kept no held-out split", "more"]
