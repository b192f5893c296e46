"""metrics.jsonl and TensorBoard logs: written per step, cut back on resume, plotted;
rewrites are atomic and a launch that writes nothing leaves no events file."""

from __future__ import annotations

import json
import os
import struct

import pytest

from jax_ai_stack import atomic
from jax_ai_stack.recipes import metrics
from multidevice import run_program


def _log(workdir, start, steps):
  log = metrics.MetricsLog(workdir, start_step=start)
  for step in steps:
    log.write(step, "train", {"loss": 1.0 / step})
    if step % 2 == 0:
      log.write(step, "eval", {"eval_loss": 2.0 / step})
  log.close()


def _events_files(workdir):
  return sorted((workdir / metrics.TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def _scalars(events_file):
  """(tag, step, value) of every scalar in a TFRecord events file."""
  from tensorboardX.proto import event_pb2

  data, found, offset = events_file.read_bytes(), [], 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
    offset += 12 + length + 4  # Length, its CRC, the record, its CRC.
    found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return found


class _Killed(BaseException):
  pass


def _kill_before_rename(monkeypatch):
  """Makes the next atomic replace die between writing the temp file and renaming it."""

  def killed(*args):
    raise _Killed

  monkeypatch.setattr(atomic.os, "replace", killed)


def test_resume_cuts_the_log_back_to_the_restored_step(tmp_path):
  _log(tmp_path, 0, range(1, 7))
  (tmp_path / metrics.METRICS_FILE).open("a").write('{"step": 7, "spl')  # Torn by a kill.
  _log(tmp_path, 4, range(5, 9))  # Resumed from step 4: steps 5-6 are written again.
  records = metrics.read_metrics(tmp_path)
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == list(range(1, 9))
  assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4, 6, 8]
  assert all(json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines())
  assert _events_files(tmp_path)


def test_a_kill_while_cutting_back_keeps_the_whole_history(tmp_path, monkeypatch):
  _log(tmp_path, 0, range(1, 7))
  before = (tmp_path / metrics.METRICS_FILE).read_bytes()
  _kill_before_rename(monkeypatch)
  with pytest.raises(_Killed):
    metrics.MetricsLog(tmp_path, start_step=4)
  assert (tmp_path / metrics.METRICS_FILE).read_bytes() == before
  assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_plot_writes_a_png(tmp_path):
  _log(tmp_path, 0, range(1, 11))
  path = metrics.plot(tmp_path)
  assert path == tmp_path / metrics.PLOT_FILE
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_the_backend_and_pyplot_alone(tmp_path):
  """A library call changes nothing process-wide: the user's backend stays, pyplot unloaded."""
  _log(tmp_path, 0, range(1, 11))
  result = run_program("plot_in_a_pdf_backend", tmp_path, check=True)
  assert result.stdout.split() == ["pdf", "False"], result.stderr
  png = (tmp_path / metrics.PLOT_FILE).read_bytes()
  assert struct.unpack(">II", png[16:24]) == (700, 400)  # IHDR: 7 x 4 inches at 100 dpi.


def test_a_kill_while_plotting_keeps_the_old_plot(tmp_path, monkeypatch):
  _log(tmp_path, 0, range(1, 11))
  before = metrics.plot(tmp_path).read_bytes()
  _log(tmp_path, 10, range(11, 21))
  _kill_before_rename(monkeypatch)
  with pytest.raises(_Killed):
    metrics.plot(tmp_path)
  assert (tmp_path / metrics.PLOT_FILE).read_bytes() == before


def test_a_launch_that_writes_nothing_leaves_no_events_file(tmp_path):
  log = metrics.MetricsLog(tmp_path, start_step=0)
  log.flush()
  log.close()
  _log(tmp_path, 0, [1])
  log = metrics.MetricsLog(tmp_path, start_step=1)  # Resumed, then killed before a step.
  log.close()
  assert len(_events_files(tmp_path)) == 1


def test_flush_makes_the_scalars_readable_before_close(tmp_path):
  log = metrics.MetricsLog(tmp_path, start_step=0)
  log.write(1, "train", {"loss": 0.5})
  log.write(2, "train", {"loss": 0.25})
  log.flush()
  [events_file] = _events_files(tmp_path)
  assert _scalars(events_file) == [("train/loss", 1, 0.5), ("train/loss", 2, 0.25)]
  assert len(metrics.read_metrics(tmp_path)) == 2
  log.close()


def test_no_log_reads_as_empty(tmp_path):
  assert metrics.read_metrics(tmp_path) == []


def test_printed_metrics_have_one_format():
  """The final line printed 'loss 1.8' where step lines and the README show three decimals."""
  assert metrics.format_metrics({"loss": 1.8, "eval_loss": 1.88, "eval_perplexity": 26.6304}) == (
      "loss 1.800, eval_loss 1.880, eval_perplexity 26.630")
