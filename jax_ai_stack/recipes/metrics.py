"""Training metrics: metrics.jsonl, TensorBoard events and the loss plot.

Each step appends one JSON line ({"step", "split", ...metrics}) and the same
scalars to TensorBoard. On resume both are cut back to the restored step, so the
log of a resumed run equals the log of a run that never stopped; a line torn by
a killed process is dropped.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
  """metrics.jsonl plus TensorBoard events, both cut back to a restored step."""

  def __init__(self, workdir: pathlib.Path, start_step: int):
    self.path = workdir / METRICS_FILE
    if self.path.exists():
      kept = [r for r in read_metrics(workdir) if r["step"] <= start_step]
      self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    self._file = self.path.open("a", encoding="utf-8")
    from tensorboardX import SummaryWriter

    self._writer = SummaryWriter(str(workdir / "tensorboard"),
                                 purge_step=start_step + 1 if start_step else None)

  def write(self, step_number: int, split: str, metrics: dict[str, float]) -> None:
    self._file.write(json.dumps({"step": step_number, "split": split, **metrics}) + "\n")
    self._file.flush()
    for key, value in metrics.items():
      self._writer.add_scalar(f"{split}/{key}", value, step_number)

  def close(self) -> None:
    self._file.close()
    self._writer.close()


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
  """The records of metrics.jsonl; a line torn by a killed process is skipped."""
  path = pathlib.Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  records = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def plot(workdir: str | pathlib.Path) -> pathlib.Path:
  """Writes loss.png: the train loss and eval loss curves of metrics.jsonl."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_metrics(workdir)
  train_points = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
  eval_points = [(r["step"], r["eval_loss"]) for r in records if r["split"] == "eval"]
  figure, axes = plt.subplots(figsize=(7, 4))
  if train_points:
    steps, losses = zip(*train_points)
    axes.plot(steps, losses, label="train", alpha=0.4, linewidth=0.8)
    window = max(len(losses) // 50, 1)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    axes.plot(steps[window - 1:], smooth, label=f"train (mean of {window})")
  if eval_points:
    steps, losses = zip(*eval_points)
    axes.plot(steps, losses, "o-", label="eval")
  axes.set_xlabel("step")
  axes.set_ylabel("loss")
  axes.set_title(pathlib.Path(workdir).name)
  axes.grid(alpha=0.3)
  axes.legend()
  path = pathlib.Path(workdir) / PLOT_FILE
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path
