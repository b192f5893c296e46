"""metrics.jsonl and TensorBoard logs: written per step, cut back on resume, plotted."""

from __future__ import annotations

import json

from jax_ai_stack.recipes import metrics


def _log(workdir, start, steps):
  log = metrics.MetricsLog(workdir, start_step=start)
  for step in steps:
    log.write(step, "train", {"loss": 1.0 / step})
    if step % 2 == 0:
      log.write(step, "eval", {"eval_loss": 2.0 / step})
  log.close()


def test_resume_cuts_the_log_back_to_the_restored_step(tmp_path):
  _log(tmp_path, 0, range(1, 7))
  (tmp_path / metrics.METRICS_FILE).open("a").write('{"step": 7, "spl')  # Torn by a kill.
  _log(tmp_path, 4, range(5, 9))  # Resumed from step 4: steps 5-6 are written again.
  records = metrics.read_metrics(tmp_path)
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == list(range(1, 9))
  assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4, 6, 8]
  assert all(json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines())
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_writes_a_png(tmp_path):
  _log(tmp_path, 0, range(1, 11))
  path = metrics.plot(tmp_path)
  assert path == tmp_path / metrics.PLOT_FILE
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_log_reads_as_empty(tmp_path):
  assert metrics.read_metrics(tmp_path) == []
