"""The trainer: config in, a trained, checkpointed, resumable run out.

`run(config, workdir)` restores the newest checkpoint in `workdir` (or starts
from the seed), then runs one jitted step per batch, evaluates every
`train.eval_every` steps, and logs each step to `metrics.jsonl` and TensorBoard.
It saves through Orbax every `checkpoint.save_every` steps, at the end, and when
SIGTERM or SIGINT arrives (the step in flight finishes first). At the end it
writes `loss.png` and, for language models, a generated sample.

Determinism: the parameters, optimizer state, RNG state and data position at
step k are all in checkpoint k, and every step is a pure function of them, so a
run stopped at any step and resumed ends with the same bits as one that never
stopped. Log lines past the restored step are dropped on resume, so the loss
log is the same too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.absl_flags import ensure_absl_flags_parsed
from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes import checkpoint, configlib, data, optim, step
from jax_ai_stack.recipes.config import RecipeConfig, from_json
from jax_ai_stack.recipes.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot, read_metrics
from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
from jax_ai_stack.recipes.models.llama import Llama, LlamaConfig, generate

log = logging.getLogger(__name__)

SAMPLE_FILE = "sample.txt"
CHECKPOINT_DIR = "checkpoints"


class TrainingError(RuntimeError):
  """Training cannot go on (a NaN loss, say); the last good checkpoint stays."""


def build_model(config: LlamaConfig | CNNConfig, seed: int) -> nnx.Module:
  """The recipe's model, initialised from `seed` (dropout gets its own stream)."""
  rngs = nnx.Rngs(params=seed, dropout=seed + 1)
  if isinstance(config, LlamaConfig):
    return Llama(config, rngs=rngs)
  return CNN(config, rngs=rngs)


def optimizer_updates(config: RecipeConfig) -> int:
  """Optimizer updates in the run: the schedule's length (accumulation groups steps)."""
  return max(config.train.steps // config.optim.accumulate_steps, 1)


def build_optimizer(config: RecipeConfig, model: nnx.Module) -> nnx.Optimizer:
  tx = optim.build(config.optim, total_steps=optimizer_updates(config))
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _check_writable(workdir: pathlib.Path) -> None:
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / ".write-test"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise WorkdirError(f"workdir {workdir} is not writable: {e.strerror or e}") from None


def _create(config: RecipeConfig, *, abstract: bool = False) -> tuple[nnx.Module, nnx.Optimizer]:
  """Model and optimizer, initialised in one compiled program (eagerly, every
  parameter initialiser would compile on its own: seconds on a small CPU).
  `abstract`: shapes only (`nnx.eval_shape`), to restore a checkpoint into."""

  def create():
    model = build_model(config.model, config.train.seed)
    return model, build_optimizer(config, model)

  return nnx.eval_shape(create) if abstract else nnx.jit(create)()


@dataclasses.dataclass
class Session:
  """Everything built from a config for one workdir, restored if it had a checkpoint."""

  config: RecipeConfig
  workdir: pathlib.Path
  model: nnx.Module
  optimizer: nnx.Optimizer
  train_step: Any
  eval_step: Any
  state: nnx.State
  manager: Any
  train_iterator: Any
  validation: Any
  tokenizer: Any
  start_step: int
  metadata: dict

  @property
  def is_lm(self) -> bool:
    return isinstance(self.config.model, LlamaConfig)

  def sync_model(self) -> None:
    """Writes the current step state into the live model (for eval and sampling)."""
    step.merge(self.model, self.optimizer, self.state)


def open_session(config: RecipeConfig, workdir: str | pathlib.Path, *, resume: str) -> Session:
  """Builds model, optimizer, data and checkpoint manager; restores per `resume`."""
  ensure_absl_flags_parsed()
  workdir = pathlib.Path(workdir)
  _check_writable(workdir)
  seed = config.train.seed
  is_lm = isinstance(config.model, LlamaConfig)
  loss_fn = step.lm_loss if is_lm else step.classification_loss
  tokenizer = data.build_tokenizer(config.data) if is_lm else None
  if is_lm and tokenizer.vocab_size > config.model.vocab_size:
    raise configlib.ConfigError(
        f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
        f"vocabulary ({tokenizer.vocab_size} ids)"
    )
  train_data = data.build_dataset(config.data, split="train", seed=seed)
  train_iterator = iter(train_data)
  validation = data.build_dataset(config.data, split="validation", seed=seed)

  manager = checkpoint.build_manager(workdir / CHECKPOINT_DIR, config.checkpoint)
  if manager.latest_step() is not None and resume == "never":
    raise WorkdirError(
        f"workdir {workdir} already has checkpoints (newest step {manager.latest_step()}) and "
        "resume is 'never': choose another --workdir, or resume with --resume auto"
    )
  restored = None
  if manager.latest_step() is not None:  # Restore into shapes; no initialisation needed.
    model, optimizer = _create(config, abstract=True)
    train_step, eval_step, abstract = step.make_steps(model, optimizer, loss_fn)
    restored = checkpoint.restore(manager, abstract, train_iterator)
  if restored is None:
    train_iterator = iter(train_data)  # A failed restore may have moved it.
    model, optimizer = _create(config)
    train_step, eval_step, state = step.make_steps(model, optimizer, loss_fn)
    start_step, metadata = 0, {}
  else:
    state, start_step, metadata = restored.state, restored.step, restored.metadata
    step.merge(model, optimizer, state)  # The abstract objects now hold the restored arrays.
    _warn_config_changes(metadata.get("config", {}), configlib.to_dict(config))
  if is_lm:
    metadata = {**metadata, "attention": _attention_choice(config, metadata.get("attention"))}
  return Session(config, workdir, model, optimizer, train_step, eval_step, state, manager,
                 train_iterator, validation, tokenizer, start_step, metadata)


def _attention_shapes(config: RecipeConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """q and k shapes of the LM's attention for one process's training batch."""
  model, batch = config.model, config.data.batch_size // jax.process_count()
  head_dim = model.resolved_head_dim
  return ((batch, config.data.seq_len, model.num_heads, head_dim),
          (batch, config.data.seq_len, model.num_kv_heads, head_dim))


def _attention_choice(config: RecipeConfig, saved: dict | None) -> dict:
  """Selects attention once, says which and why, and warns if a resume changes it."""
  q_shape, k_shape = _attention_shapes(config)
  choice = kernels.select(q_shape, k_shape, config.model.dtype, causal=True, segment_ids=True,
                          implementation=config.model.attention_impl)
  log.info("%s", choice.report())
  if saved and saved.get("implementation") != choice.name:
    log.warning("attention was %s when the checkpoint was written and is %s now: the resumed "
                "run will not be bitwise identical to one that never stopped",
                saved.get("implementation"), choice.name)
  return choice.to_dict()


def _pinned_attention(config: RecipeConfig, workdir: pathlib.Path) -> contextlib.AbstractContextManager:
  """Loads (after creating it, if asked) the workdir's attention autotune file."""
  path = workdir / kernels.AUTOTUNE_FILENAME
  if isinstance(config.model, LlamaConfig) and config.train.autotune_attention and not path.exists():
    workdir.mkdir(parents=True, exist_ok=True)
    kernels.autotune([_attention_shapes(config)], path, dtype=config.model.dtype, segment_ids=True)
  return kernels.load_autotune(path) if path.exists() else contextlib.nullcontext()


def _warn_config_changes(saved: dict, current: dict, prefix: str = "") -> None:
  """Says which settings differ from the checkpoint's: resuming with them breaks bit-exactness."""
  for key in sorted(saved.keys() | current.keys()):
    a, b = saved.get(key), current.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      _warn_config_changes(a, b, f"{prefix}{key}.")
    elif a != b:
      log.warning("config %s%s changed since the checkpoint: %r -> %r", prefix, key, a, b)


def evaluate(session: Session) -> dict[str, float]:
  """Mean metrics over the first `train.eval_batches` validation batches."""
  totals: dict[str, float] = {}
  batches = 0
  iterator = iter(session.validation)
  try:
    for batch in iterator:
      if batches == session.config.train.eval_batches:
        break
      metrics = step.host_metrics(session.eval_step(session.state, batch))
      for k, v in metrics.items():
        totals[k] = totals.get(k, 0.0) + v
      batches += 1
  finally:
    if hasattr(iterator, "close"):
      iterator.close()  # Stops its prefetch thread now, not at garbage collection.
  if batches == 0:
    raise configlib.ConfigError(
        "the validation split has no full batch: lower data.batch_size or raise "
        "data.validation_fraction"
    )
  out = {f"eval_{k}": v / batches for k, v in totals.items() if k != "tokens"}
  if session.is_lm:
    out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
  return out


class _StopSignal:
  """Records SIGTERM/SIGINT so the loop can finish its step, save and stop."""

  def __init__(self):
    self.received: str | None = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _metadata(session: Session, step_number: int) -> dict:
  return {
      "step": step_number,
      "config": configlib.to_dict(session.config),
      **{k: v for k, v in session.metadata.items() if k not in ("step", "config")},
  }


def _save(session: Session, step_number: int, *, force: bool) -> None:
  # Orbax copies the arrays to host memory before save() returns, so the next
  # step may donate (reuse) their buffers; the resume tests check the bits.
  checkpoint.save(session.manager, step_number, session.state, session.train_iterator,
                  _metadata(session, step_number), force=force)


def train(session: Session, *, stop_after: int | None = None) -> dict[str, Any]:
  """Runs the loop from `session.start_step` to `train.steps`; returns a summary."""
  config = session.config
  total = config.train.steps
  metrics_log = MetricsLog(session.workdir, session.start_step)
  schedule = jax.jit(optim.build_schedule(config.optim, optimizer_updates(config)))
  per_step = config.data.batch_size * (config.data.seq_len if session.is_lm else 1)
  unit = "tokens/s" if session.is_lm else "examples/s"
  progress = _progress_bar(config, session.start_step)
  stopped_by = None
  last: dict[str, float] = {}
  step_number = session.start_step
  try:
    with _StopSignal() as stop:
      while step_number < total:
        batch = next(session.train_iterator)
        started = time.perf_counter()
        session.state, device_metrics = session.train_step(session.state, batch)
        metrics = step.host_metrics(device_metrics)
        elapsed = time.perf_counter() - started
        step_number += 1
        if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
          raise TrainingError(
              f"step {step_number}: loss {metrics['loss']}, gradient norm {metrics['grad_norm']} "
              f"is not finite; training stopped. The last good checkpoint "
              f"(step {session.manager.latest_step()}) is kept in {session.manager.directory}"
          )
        optimizer_step = (step_number - 1) // config.optim.accumulate_steps
        metrics.update(lr=float(schedule(optimizer_step)), step_time=elapsed,
                       throughput=per_step / max(elapsed, 1e-9))
        metrics.pop("tokens", None)
        metrics_log.write(step_number, "train", metrics)
        last = metrics
        if progress is not None:
          progress.update(1)
          progress.set_postfix_str(f"loss {metrics['loss']:.3f}  {metrics['throughput']:,.0f} {unit}")
        if step_number % config.train.eval_every == 0 or step_number == total:
          eval_metrics = evaluate(session)
          metrics_log.write(step_number, "eval", eval_metrics)
          last.update(eval_metrics)
          _print(progress, f"step {step_number}: " + _format(eval_metrics))
        should_stop = stop.received or (stop_after is not None and step_number >= stop_after)
        _save(session, step_number, force=bool(should_stop) or step_number == total)
        if should_stop:
          stopped_by = stop.received or f"stop_after={stop_after}"
          break
  finally:
    if progress is not None:
      progress.close()
    session.manager.wait_until_finished()
    metrics_log.close()
  session.sync_model()
  return {"step": step_number, "stopped_by": stopped_by, **last}


def _progress_bar(config: RecipeConfig, start: int):
  if not config.train.progress:
    return None
  from tqdm import tqdm

  return tqdm(total=config.train.steps, initial=start, desc="train", unit="step",
              file=sys.stderr, mininterval=0.5, dynamic_ncols=True)


def _print(progress, text: str) -> None:
  if progress is not None:
    progress.write(text, file=sys.stdout)
  else:
    print(text, flush=True)


def _format(metrics: dict[str, float]) -> str:
  return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def sample(session: Session, prompt: str, max_new_tokens: int, temperature: float) -> str:
  """Text generated by the session's language model from `prompt`."""
  tokenizer, config = session.tokenizer, session.config
  prompt_ids = np.asarray(tokenizer.encode(prompt), dtype=np.int32)
  if prompt_ids.size == 0:
    prompt_ids = np.asarray([tokenizer.bos_id], dtype=np.int32)
  room = config.model.max_seq_len - prompt_ids.size
  if room <= 0:
    raise configlib.ConfigError(
        f"the prompt is {prompt_ids.size} tokens, more than model.max_seq_len "
        f"({config.model.max_seq_len})"
    )
  tokens = generate(session.model, prompt_ids[None, :], min(max_new_tokens, room),
                    temperature=temperature, rng=jax.random.key(config.train.seed))
  return tokenizer.decode(np.asarray(tokens[0]))


def run(
    config: RecipeConfig,
    workdir: str | pathlib.Path | None = None,
    *,
    resume: str | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
  """Trains `config` in `workdir` (default runs/<name>); returns the final metrics.

  `stop_after` stops (and saves) after that step as a preemption would; the next
  call resumes from there.
  """
  workdir = pathlib.Path(workdir or pathlib.Path("runs") / config.name)
  with _pinned_attention(config, workdir):
    return _run(config, workdir, resume=resume or config.train.resume, stop_after=stop_after)


def _run(config: RecipeConfig, workdir: pathlib.Path, *, resume: str,
         stop_after: int | None) -> dict[str, Any]:
  session = open_session(config, workdir, resume=resume)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(session.model, nnx.Param)))
  print(f"recipe {config.name}: {n_params:,} parameters on {jax.default_backend()} "
        f"({jax.device_count()} device(s)); workdir {workdir}", flush=True)
  if "attention" in session.metadata:
    attention = session.metadata["attention"]
    print(f"attention: {attention['implementation']} ({attention['source']})", flush=True)
  if session.start_step:
    print(f"resumed from step {session.start_step}", flush=True)
  if session.start_step >= config.train.steps:
    print(f"already trained to step {config.train.steps}: nothing to do", flush=True)
    session.manager.close()
    result = _final_metrics(workdir)
    _print_done(result, workdir)
    return result
  try:
    result = train(session, stop_after=stop_after)
  finally:
    session.manager.close()
  if result["stopped_by"]:
    print(f"stopped at step {result['step']} ({result['stopped_by']}); checkpoint saved. "
          "Run the same command again to resume.", flush=True)
    return result
  plot(workdir)
  if session.is_lm and config.train.sample_tokens:
    text = sample(session, config.train.sample_prompt, config.train.sample_tokens,
                  config.train.sample_temperature)
    (workdir / SAMPLE_FILE).write_text(text, encoding="utf-8")
    print(f"sample:\n{text}\n", flush=True)
  _print_done(result, workdir)
  return result


def _print_done(result: dict[str, Any], workdir: pathlib.Path) -> None:
  shown = {k: v for k, v in result.items() if k.startswith(("loss", "eval_"))}
  print(f"done: step {result.get('step')}, {_format(shown)}", flush=True)
  print(f"metrics {workdir / METRICS_FILE}, plot {workdir / PLOT_FILE}, "
        f"checkpoints {workdir / CHECKPOINT_DIR}", flush=True)


def _final_metrics(workdir: pathlib.Path) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for record in read_metrics(workdir):
    out.update({k: v for k, v in record.items() if k != "split"})
  return out


def open_trained(workdir: str | pathlib.Path) -> Session:
  """A session restored from a workdir's newest checkpoint, with its saved config."""
  workdir = pathlib.Path(workdir)
  directory = workdir / CHECKPOINT_DIR
  if not directory.is_dir():
    raise WorkdirError(f"no checkpoints in {workdir}: train there first")
  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig())
  if manager.latest_step() is None:
    raise WorkdirError(f"no checkpoints in {directory}: train there first")
  config = from_json(checkpoint.read_metadata(manager)["config"])
  manager.close()
  session = open_session(config, workdir, resume="auto")
  session.sync_model()
  return session

