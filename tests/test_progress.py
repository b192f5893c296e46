"""Progress bars: tqdm on a terminal, plain lines elsewhere."""

import io
import pathlib
import re
import time

import jax_ai_stack

from jax_ai_stack.recipes import progress


def test_lines_say_where_they_are_and_how_long_is_left():
  out = io.StringIO()
  lines = progress.Lines("step", total=600, initial=100, file=out)
  lines.update(50)
  lines.set_postfix_str("loss 1.900")
  assert out.getvalue().startswith("step 150/600: loss 1.900, ETA ")
  unknown = progress.Lines("doc", total=None, initial=0, file=out)
  unknown.update(8)
  unknown.set_postfix_str("1,000 tokens/s")
  assert out.getvalue().splitlines()[-1] == "doc 8: 1,000 tokens/s"  # No total: no ETA.


def test_off_a_terminal_the_bar_is_lines(capsys):
  bar = progress.bar("train", unit="step", total=4)  # pytest's stderr is no terminal.
  assert isinstance(bar, progress.Lines)
  bar.update(2)
  bar.set_postfix_str("loss 2.000")
  assert capsys.readouterr().err.startswith("step 2/4: loss 2.000, ETA ")


def test_a_bar_without_a_postfix_writes_a_line_at_each_tenth():
  out = io.StringIO()
  lines = progress.Lines("B", total=2_000_000, initial=0, file=out, label="load", unit_scale=True)
  for _ in range(40):
    lines.update(50_000)
  said = out.getvalue().splitlines()
  assert len(said) == 10 and said[0].startswith("load 200kB/2.00MB (10%), ETA "), said
  assert said[-1].startswith("load 2.00MB/2.00MB (100%)")


def test_a_disabled_bar_says_nothing_anywhere(capsys):
  with progress.bar("scoring", unit="request", total=3, tenths=True, disable=True) as bar:
    bar.update(3)
    bar.set_postfix_str("done")
  assert capsys.readouterr().err == ""


def test_every_bar_of_the_package_goes_through_progress_bar():
  """A tqdm drawn directly writes \\r frames into a log file; `progress.bar` writes lines."""
  package = pathlib.Path(jax_ai_stack.__file__).parent
  direct = [str(path.relative_to(package)) for path in package.rglob("*.py")
            if path.name != "progress.py" and re.search(r"\btqdm\(", path.read_text())]
  assert direct == []


def test_a_quick_wait_says_nothing_and_a_long_one_says_what_it_does_as_it_goes(
    capsys, monkeypatch):
  with progress.waiting("quick", done=lambda wait: "quick done"):
    pass
  assert capsys.readouterr().err == ""  # A quick phase stays silent, its outcome too.
  monkeypatch.setattr(progress, "QUIET_S", 0.3)
  monkeypatch.setattr(progress, "EVERY_S", 0.8)
  with progress.waiting("tracing f", done=lambda wait: f"traced f in {wait.elapsed_s:.1f} s"):
    time.sleep(2.0)
  said = capsys.readouterr().err.splitlines()
  assert said[0] == "tracing f ..." and said[-1].startswith("traced f in 2.")
  assert len(said) >= 3 and re.fullmatch(r"tracing f \.\.\. [12] s", said[1]), said  # Heartbeat.


def test_the_newest_wait_speaks_and_the_older_one_keeps_quiet_meanwhile(capsys, monkeypatch):
  monkeypatch.setattr(progress, "QUIET_S", 0.0)
  monkeypatch.setattr(progress, "EVERY_S", 1.0)
  with progress.waiting("sampling 8 tokens", done=lambda wait: "sampled"):
    with progress.waiting("compiling decode", done=lambda wait: "compiled decode"):
      time.sleep(1.7)
  said = capsys.readouterr().err.splitlines()
  assert said[:2] == ["sampling 8 tokens ...", "compiling decode ..."], said
  assert said[2].startswith("compiling decode ... ") and said[-2:] == ["compiled decode", "sampled"]
  assert not any(line.startswith("sampling 8 tokens ... ") for line in said)  # One heartbeat.
