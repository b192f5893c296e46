"""Post-training quantization of a finished run: quantize, compare, save, serve.

`quantize_run(workdir, scheme)` restores the run's newest checkpoint, builds
Qwix's PTQ model of it (`quant.ptq`), evaluates both on the run's validation
batches, and saves the quantized parameters (int8/int4 values and their
scales) under `<workdir>/quantized/<scheme>/<step>/`. `open_quantized` gives
back a read-only `Run` whose model is that quantized one, which is what
`eval --quantized` and `generate --quantized` run.

A run trained with `quant.qat` quantizes to its own scheme by default: QAT
learned weights that lose little in exactly that conversion.

The save is one Orbax step (written into a temporary directory and renamed
when complete), so a killed `quantize` leaves the previous result or the new
one, never half of one; the training checkpoints are only read. Quantizing
the same training step again rewrites nothing: the same rules give the same
bits.

Example:
  >>> report = quantize_run("runs/lm-tiny", "w8")  # doctest: +SKIP
  >>> print(report.table())  # doctest: +SKIP
  >>> quantized_dir("runs/lm-tiny", "w8")  # Where the quantized parameters go.
  PosixPath('runs/lm-tiny/quantized/w8')
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jax_ai_stack import logs
from jax_ai_stack.errors import UsageError, WorkdirError
from jax_ai_stack.recipes import checkpoint
from jax_ai_stack.recipes.finetune import quant
from jax_ai_stack.recipes.run import Run, build_run
from jax_ai_stack.recipes.workdir import prepare_workdir

QUANTIZED_DIR = "quantized"
"""In the workdir: one directory per scheme, holding the newest quantized step."""


@dataclasses.dataclass(frozen=True)
class Report:
  """What `quantize_run` measured and where it saved the result."""

  scheme: str
  step: int
  trained: str
  """How the run trained: "float", or "qat <scheme>"."""
  metrics: dict[str, float]
  """Validation metrics of the run as trained."""
  quantized_metrics: dict[str, float]
  """The same metrics of the PTQ model."""
  param_bytes: int
  quantized_param_bytes: int
  path: pathlib.Path
  saved: bool
  """False when this step was already quantized with this scheme (nothing rewritten)."""

  def table(self) -> str:
    """Float (or QAT) vs quantized: each metric, the parameter bytes, and the deltas."""
    keys = list(self.metrics)
    rows = [
        [self.trained, *(f"{self.metrics[k]:.4f}" for k in keys), f"{self.param_bytes:,}"],
        [self.scheme, *(f"{self.quantized_metrics[k]:.4f}" for k in keys),
         f"{self.quantized_param_bytes:,}"],
        ["delta", *(f"{self.quantized_metrics[k] - self.metrics[k]:+.4f}" for k in keys),
         f"x{self.quantized_param_bytes / self.param_bytes:.3f}"],
    ]
    header = ["model", *keys, "param_bytes"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), *(line(r) for r in rows)])


def quantized_dir(workdir: str | pathlib.Path, scheme: str) -> pathlib.Path:
  return pathlib.Path(workdir) / QUANTIZED_DIR / quant.check_scheme(scheme)


def quantize_run(workdir: str | pathlib.Path, scheme: str | None = None, *,
                 overrides: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None,
                 capture_stderr: bool = False) -> Report:
  """Quantizes the run in `workdir` with `scheme` (default: its `quant.qat`), evaluates, saves.

  `overrides` (dotted data fields) apply over the run's saved config for the evaluation;
  `environ` and `capture_stderr` are `build_run`'s.

  Raises:
    SchemeError: an unknown scheme (before anything is opened).
    UsageError: no scheme given, and the run did not train with `quant.qat`.
    WorkdirError: no checkpoint in `workdir`, or it is not writable.
  """
  if scheme is not None:
    quant.check_scheme(scheme)
  workdir = pathlib.Path(workdir)
  trainer = build_run(None, workdir, mode="read", validation=True, overrides=overrides,
                      environ=environ, capture_stderr=capture_stderr)
  try:
    config = trainer.config
    qat = config.quant.qat
    scheme = scheme or qat
    if scheme is None:
      raise UsageError(f"name a scheme with --scheme ({quant.describe_schemes()}); the run in "
                       f"{workdir} did not train with quant.qat")
    prepare_workdir(workdir, read_only=False)  # Writable? Checked before any work.
    metrics = trainer.evaluate()
    trainer.model.eval()
    quantized = _with_model(trainer, quant.ptq(trainer.model, scheme, config.model))
    quantized_metrics = quantized.evaluate()
    path, saved = _save(workdir, scheme, trainer.step, quantized.model,
                        {"scheme": scheme, "step": trainer.step, "trained_with_qat": qat,
                         "metrics": quantized_metrics})
  finally:
    trainer.close()
  return Report(scheme, trainer.step, f"qat {qat}" if qat else "float", metrics,
                quantized_metrics, quant.param_bytes(trainer.model),
                quant.param_bytes(quantized.model), path, saved)


def open_quantized(workdir: str | pathlib.Path, scheme: str, *, validation: bool = False,
                   method: str = "__call__", overrides: Sequence[str] = (),
                   environ: Mapping[str, str] | None = None, capture_stderr: bool = False) -> Run:
  """The finished run in `workdir`, read-only, with its saved `scheme` parameters.

  `method`: what the model runs quantized ("__call__": evaluation; "decode":
  `generate`); `overrides`, `environ` and `capture_stderr` are `build_run`'s.
  Raises WorkdirError when `quantize` has not saved `scheme` there.
  """
  directory = quantized_dir(workdir, scheme)
  trainer = build_run(None, workdir, mode="read", validation=validation, overrides=overrides,
                      environ=environ, capture_stderr=capture_stderr)
  try:
    if not directory.is_dir():
      raise WorkdirError(f"no {scheme} parameters in {directory.parent}: run `jax-ai-stack "
                         f"quantize --workdir {workdir} --scheme {scheme}` first")
    trainer.model.eval()
    method = method if method in trainer.task.methods else "__call__"  # E.g. no decode.
    model = nnx.eval_shape(lambda: quant.ptq(trainer.model, scheme, trainer.config.model,
                                             method=method))
    with _manager(directory, read_only=True) as manager:
      step = manager.latest_step()
      if step is None:
        raise WorkdirError(f"no complete quantized step in {directory}: run `jax-ai-stack "
                           f"quantize --workdir {workdir} --scheme {scheme}` again")
      if step != trainer.step:
        logs.note(f"the {scheme} parameters in {directory} were quantized from step {step}; "
                  f"the run is at step {trainer.step}: run `jax-ai-stack quantize` again to "
                  "update them")
      abstract = nnx.state(model, nnx.Param)
      restored = manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(nnx.to_pure_dict(abstract))))
    nnx.replace_by_pure_dict(abstract, restored["params"])
    nnx.update(model, abstract, nnx.state(trainer.model, nnx.Not(nnx.Param)))
    return _with_model(trainer, model)
  except BaseException:
    trainer.close()
    raise


def _with_model(trainer: Run, model: nnx.Module) -> Run:
  """`trainer` evaluating and generating with `model` (no optimizer: it does not train)."""
  graphdef, state = nnx.split(model)
  loss = trainer.task.training_loss(trainer.transforms)

  @jax.jit
  def eval_step(state, batch):
    value, aux = loss(nnx.merge(graphdef, state), batch)
    return {"loss": value, **aux}

  return dataclasses.replace(trainer, model=model, state=state, eval_step=eval_step,
                             train_step=None, optimizer=None)


def _manager(directory: pathlib.Path, *, read_only: bool = False) -> ocp.CheckpointManager:
  """Orbax's manager of one scheme's directory: the newest step only, written synchronously."""
  if read_only:  # The options Orbax would force (with a warning each) for a read-only manager.
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                           enable_async_checkpointing=False)
  else:
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True, cleanup_tmp_directories=True,
                                           enable_async_checkpointing=False)
  with checkpoint.manager._without_absl_warning("Given directory is read only"):  # noqa: SLF001
    return ocp.CheckpointManager(directory.absolute(), options=options)


def _save(workdir: pathlib.Path, scheme: str, step: int, model: nnx.Module,
          metadata: dict[str, Any]) -> tuple[pathlib.Path, bool]:
  """Saves `model`'s parameters as step `step`; False when that step is already there."""
  directory = quantized_dir(workdir, scheme)
  with _manager(directory) as manager:
    if step in manager.all_steps():
      return directory / str(step), False
    manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model, nnx.Param))),
        meta=ocp.args.JsonSave(metadata)))
    manager.wait_until_finished()
  return directory / str(step), True
