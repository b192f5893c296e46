"""Training metrics: metrics.jsonl, TensorBoard events and the loss plot.

Each step appends one JSON line ({"step", "split", ...metrics}) and the same
scalars to TensorBoard. On resume both are cut back to the restored step, so the
log of a resumed run equals the log of a run that never stopped; a line torn by
a killed process is dropped.

Files that are rewritten rather than appended to (metrics.jsonl when it is cut
back, loss.png) are replaced atomically (`jax_ai_stack.atomic`): a kill at any
moment leaves the old file or the new one, never an empty or half one. The
TensorBoard events file is created at the first scalar, so a launch that is
killed (or fails) before its first step leaves no empty events file behind.

Example:
  >>> import pathlib
  >>> log = MetricsLog(pathlib.Path("."), start_step=0)
  >>> log.write(1, "train", {"loss": 2.5})
  >>> log.close()
  >>> read_metrics(".")
  [{'step': 1, 'split': 'train', 'loss': 2.5}]
"""

from __future__ import annotations

import io
import json
import pathlib
import time
import uuid

import numpy as np

from jax_ai_stack.atomic import write_atomically

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
  """metrics.jsonl plus TensorBoard events, both cut back to a restored step.

  Call `flush()` after each checkpoint save, so what is on disk covers at least
  the saved steps, and `close()` at the end.
  """

  def __init__(self, workdir: pathlib.Path, start_step: int, *, enabled: bool = True):
    """Opens the log of a run that continues after `start_step` (0: a new run).

    `enabled` False writes nothing: the processes of a multi-host job other
    than the first, which share its workdir.
    """
    self.workdir = pathlib.Path(workdir)
    self.start_step = start_step
    self.path = self.workdir / METRICS_FILE
    self._file = self._events = None
    if not enabled:
      return
    if self.path.exists():
      _cut_back(self.workdir, start_step)
    self._file = self.path.open("a", encoding="utf-8")

  def write(self, step_number: int, split: str, metrics: dict[str, float]) -> None:
    """Appends one record to both logs; the JSON line reaches the OS at once."""
    if self._file is None:
      return
    self._file.write(json.dumps({"step": step_number, "split": split, **metrics}) + "\n")
    self._file.flush()
    events = self._events_file()
    for key, value in metrics.items():
      events.write_event(_scalar_event(f"{split}/{key}", value, step_number))

  def flush(self) -> None:
    """Hands everything written so far to the OS, so a kill after this loses none of it."""
    if self._file is not None:
      self._file.flush()
    if self._events is not None:
      self._events.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._events is not None:
      self._events.close()

  def _events_file(self):
    """The TensorBoard events file, created at the first scalar.

    Written synchronously with tensorboardX's `EventsWriter` (what its
    `SummaryWriter` uses behind a queue and a thread): `SummaryWriter.flush()`
    does not write the events still queued, so it cannot back `flush()`.
    """
    if self._events is None:
      from tensorboardX.event_file_writer import EventsWriter
      from tensorboardX.proto.event_pb2 import Event, SessionLog

      directory = self.workdir / TENSORBOARD_DIR
      directory.mkdir(parents=True, exist_ok=True)
      # Two launches in one second would get the same file name; the second would truncate it.
      self._events = EventsWriter(str(directory / "events"), filename_suffix=f".{uuid.uuid4().hex[:8]}")
      if self.start_step:  # TensorBoard hides what an earlier launch logged after this step.
        self._events.write_event(Event(step=self.start_step + 1, wall_time=time.time(),
                                       session_log=SessionLog(status=SessionLog.START)))
    return self._events


def _scalar_event(tag: str, value: float, step_number: int):
  """The Event that `SummaryWriter.add_scalar` would queue."""
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.summary import scalar

  return Event(summary=scalar(tag, value), step=step_number, wall_time=time.time())


def _cut_back(workdir: pathlib.Path, last_step: int) -> None:
  """Drops the records after `last_step` (and torn lines) in one atomic replace."""
  kept = [r for r in read_metrics(workdir) if r["step"] <= last_step]
  write_atomically(workdir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))


def format_metrics(metrics: dict[str, float]) -> str:
  """'loss 1.800, eval_loss 1.880': one format for every printed metric (three decimals,
  as the progress bar shows the loss)."""
  return ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())


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
  """Writes loss.png (atomically): the train and eval loss curves of metrics.jsonl, and on
  a second axis the held-out reward of a reinforcement-learning run and the scores of
  `train.eval_tasks` (eval_harness_*).

  Drawn on a figure of its own with the Agg canvas, not through pyplot: the
  process's matplotlib backend and pyplot's figures are left as they are.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_metrics(workdir)
  train_points = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
  eval_points = [(r["step"], r["eval_loss"]) for r in records
                 if r["split"] == "eval" and "eval_loss" in r]
  evals = [r for r in records if r["split"] == "eval"]
  second = sorted({k for r in evals for k in r
                   if k == "eval_reward" or k.startswith("eval_harness_")})
  figure = Figure(figsize=(7, 4))
  FigureCanvasAgg(figure)
  axes = figure.subplots()
  if train_points:
    steps, losses = zip(*train_points)
    axes.plot(steps, losses, label="train", alpha=0.4, linewidth=0.8)
    window = max(len(losses) // 50, 1)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    axes.plot(steps[window - 1:], smooth, label=f"train (mean of {window})")
  if eval_points:
    steps, losses = zip(*eval_points)
    axes.plot(steps, losses, "o-", label="eval")
  if second:
    twin = axes.twinx()
    for name in second:
      steps, values = zip(*[(r["step"], r[name]) for r in evals if name in r])
      label = "eval reward" if name == "eval_reward" else name.removeprefix("eval_harness_")
      twin.plot(steps, values, "s-", label=label,
                **({"color": "tab:green"} if name == "eval_reward" else {}))
    twin.set_ylabel("held-out reward" if second == ["eval_reward"] else "held-out score")
    twin.legend(loc="upper right")
  axes.set_xlabel("step")
  axes.set_ylabel("loss")
  axes.set_title(pathlib.Path(workdir).name)
  axes.grid(alpha=0.3)
  axes.legend()
  figure.tight_layout()
  png = io.BytesIO()
  figure.savefig(png, format="png", dpi=100)
  path = pathlib.Path(workdir) / PLOT_FILE
  write_atomically(path, png.getvalue())
  return path


def eval_change(workdir: str | pathlib.Path, learning_rate: float) -> list[str]:
  """'held-out eval_loss 2.1 before fine-tuning -> 1.7 at step 200' from a run's
  metrics.jsonl, if it has both; when the loss rose, a hint about `learning_rate`
  (a pretraining rate on a trained base undoes what the base learned)."""
  records = [r for r in read_metrics(workdir) if r["split"] == "eval"]
  rewards = [r for r in records if "eval_reward" in r]
  if len(rewards) >= 2 and rewards[0]["step"] == 0:  # Reinforcement learning: the reward.
    return [f"held-out eval_reward {rewards[0]['eval_reward']:.4f} before fine-tuning -> "
            f"{rewards[-1]['eval_reward']:.4f} at step {rewards[-1]['step']}"]
  evals = [r for r in records if "eval_loss" in r]
  if len(evals) < 2 or evals[0]["step"] != 0:
    return []
  first, last = evals[0], evals[-1]
  lines = [f"held-out eval_loss {first['eval_loss']:.4f} before fine-tuning -> "
           f"{last['eval_loss']:.4f} at step {last['step']}"]
  if last["eval_loss"] > first["eval_loss"]:
    lines.append(f"hint: held-out loss rose; fine-tuning usually takes a learning rate well "
                 f"below pretraining's: try optim.learning_rate={learning_rate / 10:g} (this run "
                 f"{learning_rate:g}) or fewer train.steps")
  return lines
