"""`jax-ai-stack train` and `eval`: the recipes from the command line (`generate`:
`recipes.generate_cli`).

    jax-ai-stack train [PRESET] [--config FILE.yaml] [--workdir DIR] [dotted overrides]
    jax-ai-stack train ... --distributed auto            (one process per host, on a cluster)
    jax-ai-stack train ... --coordinator HOST:PORT --num-processes N --process-id I
    jax-ai-stack train ... --dry-run [--device-memory 16GiB]   (the memory plan; trains nothing)
    jax-ai-stack train --list
    jax-ai-stack train --replay RUN/record.json --workdir NEW   (every phase of a run again)
    jax-ai-stack generate --workdir DIR --prompt TEXT [--quantized SCHEME]
    jax-ai-stack eval --workdir DIR [--quantized SCHEME] [data.* overrides]

Overrides take either form: `model.num_layers=6` or `--model.num_layers 6`.

Example: the config a `train` command line resolves to (nothing is trained).
  >>> import argparse
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args, args.overrides = parser.parse_known_args(
  ...     ["train", "digits-cnn", "--workdir", "runs/x", "train.steps=20",
  ...      "--data.batch_size", "16"])
  >>> config = load_config(args)
  >>> config.name, config.train.steps, config.data.batch_size, args.workdir
  ('digits-cnn', 20, 16, 'runs/x')
  >>> eval_overrides(argparse.Namespace(command="eval", overrides=["--data.batch_size", "4"]))
  ['data.batch_size=4']
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

from jax_ai_stack import logs
from jax_ai_stack.errors import DataError, UsageError

# Exit codes of a run stopped early (after saving), as shells report a signal.
STOPPED_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
_OTHER_STOP_EXIT_CODE = 75  # EX_TEMPFAIL: preempted or stopped by request; run again.

_TRAIN_EPILOG = """\
The config is the preset (default lm-tiny; `--preset none` for the defaults
alone), then --config FILE merged over it (any section may be partial; a file
may name its base with `preset: NAME`), then the overrides.

Several processes (hosts) train one job when each is started with the same
command plus --distributed auto (TPU pod slices, SLURM, Open MPI, Kubernetes:
JAX reads the cluster from the environment) or the explicit --coordinator,
--num-processes and --process-id. The mesh spans every process's devices;
process 0 writes metrics, plot and sample; all write the checkpoint together.
A process waits --distributed-timeout (default 120 s) for the others at start;
once running, a process silent for --heartbeat-timeout (default 10 s: killed,
or its host lost) stops the others, each printing one line that names it.

Exit status: 0 trained (or already finished, or stopped at --stop-after, saved);
2 bad input (one line says what);
130 stopped by Ctrl-C (SIGINT) and 143 by SIGTERM, after saving a checkpoint
(run the same command again to resume); 75 stopped by a preemption (SIGTERM
to a process of a multi-process job: every process saves the same step; a
SIGINT to one process stops them all alike, that one exiting 130) or by
request; 69 another process of a multi-process job stopped answering (the
last checkpoint is kept: start every process again to resume); 1 a training
failure (a non-finite loss) or a bug (with its traceback).
"""


EVAL_OVERRIDES_EPILOG = """\
Overrides: data.* fields and train.eval_batches, over the run's saved config
(the model and its checkpoint stay the run's). A validation split too small
for one batch (a run trained on a few KB) is refused, naming the numbers:
lower data.batch_size, or raise data.validation_fraction; the split is chosen
by hash below the fraction, so a larger one also holds text the run trained
on (said on stderr).
"""
"""How `eval` and `quantize` take overrides (their --help's epilog)."""

_EVAL_OVERRIDE_FIELDS = ("data.", "train.eval_batches")


def register(subparsers) -> None:
  from jax_ai_stack.recipes import distributed  # Standard library only: cheap.

  train = subparsers.add_parser(
      "train",
      help="train a recipe (default: lm-tiny); run again to resume",
      description="Train a preset recipe. Extra arguments are dotted config overrides "
      "(model.num_layers=6 or --model.num_layers 6).",
      epilog=_TRAIN_EPILOG,
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  train.add_argument("--list", action="store_true", help="list the presets and exit")
  train.add_argument("--preset", help="the preset to start from ('none': the defaults); "
                     "the same as naming it first")
  train.add_argument("--config", help="a YAML file merged over the preset")
  train.add_argument("--workdir", help="where checkpoints and logs go (default: runs/<preset>)")
  train.add_argument("--resume", choices=("auto", "never"), help="override train.resume")
  train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
  train.add_argument("--replay", metavar="RECORD",
                     help="re-run every phase of a run's record.json into a new --workdir "
                     "(the configs come from the record: no preset, --config or overrides)")
  train.add_argument("--stop-after", type=int, metavar="STEP",
                     help="stop after this step and save, as a preemption would, without "
                     "changing train.steps (a decaying schedule keeps its horizon): a planned "
                     "phase boundary; exits 0, and the next train command goes on from there")
  train.add_argument("--dry-run", action="store_true",
                     help="print the mesh and the per-device memory plan, then exit (trains nothing)")
  train.add_argument("--topology", metavar="NAME",
                     help="with --dry-run: compile the run's steps for a TPU slice or GPU host "
                     "this machine does not have (v5e:2x2, v6e:4x4, h100:8, ...) and print "
                     "XLA's bytes, the kernels and the roofline on that chip")
  train.add_argument("--device-memory", metavar="SIZE",
                     help="memory per device for --dry-run's largest batch, e.g. 16GiB "
                     "(default: what the device reports)")
  train.add_argument("--verbose", action="store_true",
                     help="after the first step, print where the start-up went: import, init, "
                     "trace and compile seconds, compilation-cache hits; and show the "
                     "libraries' log lines (kept in WORKDIR/jax-ai-stack.log otherwise)")
  launch = train.add_argument_group("several processes (hosts)")
  launch.add_argument("--distributed", choices=("off", "auto", "explicit"),
                      help="auto: join the cluster JAX detects; explicit: implied by the next "
                      "three flags (default off: one process)")
  launch.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address and a free port")
  launch.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
  launch.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
  launch.add_argument("--distributed-timeout", type=int, metavar="SECONDS",
                      help="how long to wait for the other processes at start (default "
                      f"{distributed.DEFAULT_TIMEOUT_S})")
  launch.add_argument("--heartbeat-timeout", type=int, metavar="SECONDS",
                      help="a process silent this long counts as dead: the others stop with "
                      f"exit status {distributed.PEER_LOST_EXIT_CODE} (default "
                      f"{distributed.DEFAULT_HEARTBEAT_TIMEOUT_S})")
  train.set_defaults(func=run_train, accepts_overrides=True)

  evaluate = subparsers.add_parser(
      "eval", help="evaluate a trained workdir on its validation split",
      description="Evaluate the newest checkpoint in --workdir on the run's validation split "
      "(read-only); prints JSON. Extra arguments are dotted data overrides applied over the "
      "run's saved config, as `train` takes them (data.validation_fraction=0.2, "
      "data.batch_size=4, train.eval_batches=2).",
      epilog=EVAL_OVERRIDES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  evaluate.add_argument("--workdir", required=True, help="a workdir `train` wrote")
  evaluate.add_argument("--quantized", metavar="SCHEME",
                        help="evaluate the parameters `quantize --scheme SCHEME` saved in --workdir")
  evaluate.add_argument("--tasks", metavar="A,B",
                        help="run lm-evaluation-harness tasks instead: registered names, "
                        "task YAML files or directories of them, or `stdlib` (four tasks "
                        "made from the standard library), comma-separated (the eval extra); "
                        "their data must be on disk")
  evaluate.add_argument("--limit", type=float, metavar="N",
                        help="--tasks: at most N examples per task (a fraction if below 1)")
  evaluate.add_argument("--num-fewshot", type=int, metavar="K",
                        help="--tasks: K examples in each prompt (default: the task's)")
  evaluate.add_argument("--batch-size", type=int, default=8,
                        help="--tasks: rows per scoring batch, requests decoded at once "
                        "(default 8)")
  evaluate.add_argument("--apply-chat-template", action="store_true",
                        help="--tasks: render each prompt with the run's chat template")
  evaluate.set_defaults(func=run_eval, accepts_overrides=True)


def _split_preset(extra: list[str]) -> tuple[str | None, list[str]]:
  """The first bare word (no '=', no leading '--') is the preset; the rest are overrides."""
  if extra and not extra[0].startswith("-") and "=" not in extra[0]:
    return extra[0], extra[1:]
  return None, extra


def load_config(args: argparse.Namespace):
  """The RecipeConfig that --preset (or a first bare word), --config and the overrides give."""
  from jax_ai_stack.recipes import config as recipe_config
  from jax_ai_stack.recipes import configlib

  preset, extra = _split_preset(args.overrides)
  if preset and args.preset and preset != args.preset:
    raise UsageError(f"two presets: {preset!r} and --preset {args.preset!r}")
  return recipe_config.load(
      preset or args.preset, config_file=args.config, overrides=configlib.parse_overrides(extra)
  )


def run_train(args: argparse.Namespace) -> int:
  from jax_ai_stack import determinism
  from jax_ai_stack.recipes import config as recipe_config
  from jax_ai_stack.recipes import compile_cache, distributed

  if args.list:
    names = recipe_config.list_presets()
    width = max(len(name) for name in names) + len(" (default)")
    for name in names:
      marker = " (default)" if name == recipe_config.DEFAULT_PRESET else ""
      print(f"{name + marker:<{width}}  {recipe_config.preset_description(name)}")
    return 0
  launch = distributed.Launch.from_flags(
      args.distributed, coordinator=args.coordinator, num_processes=args.num_processes,
      process_id=args.process_id, timeout_s=args.distributed_timeout,
      heartbeat_timeout_s=args.heartbeat_timeout)
  if args.stop_after is not None and (args.replay or args.stop_after < 1):
    raise UsageError(f"--stop-after {args.stop_after}: " + (
        "a replay stops where the record's phases began; leave --stop-after out"
        if args.replay else "give a step >= 1"))
  replayed = _replayed_record(args)
  config = load_config(args) if replayed is None else replayed[0]
  if args.print_config:
    print(recipe_config.printed(config), end="")
    return 0
  import_started = time.perf_counter()
  from jax_ai_stack.recipes import train  # jax and the libraries: only to train.
  import_s = time.perf_counter() - import_started

  if args.topology:  # Programs for chips not here: no cache, no processes, no GPU flags.
    from jax_ai_stack import topology
    from jax_ai_stack.recipes import aot, preflight

    topology.host_cpu_only()

    preflight.check_references(config)
    return aot.dry_run(config, args.topology, dry_run=args.dry_run, environ=os.environ)
  workdir = train.default_workdir(config, args.workdir)
  determinism.configure(config.train.deterministic)  # XLA reads its flags at start-up.
  distributed.initialize(launch, checkpoints=workdir / train.CHECKPOINT_DIR)  # Before any device.
  compile_cache.enable(config.train.compile_cache)  # Before the first compile.
  if args.dry_run:
    from jax_ai_stack import kernels
    from jax_ai_stack.recipes import memory, preflight

    preflight.check_references(config)  # As training would: a bad reward fails the plan too.

    print(memory.dry_run(config, device_memory_text=args.device_memory, environ=os.environ,
                         autotune_file=kernels.workdir_autotune_file(workdir)))
    return 0
  args.log_routes.keep_in(logs.log_path(workdir, _process_index(launch)), held=True)
  run_phase = functools.partial(train.run, workdir=workdir, resume=args.resume,
                                verbose=args.verbose, import_s=import_s,
                                on_open=args.log_routes.release, environ=os.environ,
                                capture_stderr=True)
  try:
    if replayed is None:
      result = run_phase(config, stop_after=args.stop_after)
    else:
      saved = distributed.latest_saved_step(workdir / train.CHECKPOINT_DIR)
      result = _replay(replayed[1], run_phase, saved)
  except train.TrainingError as e:
    print(f"jax-ai-stack train: {e}")
    return 1
  stopped_by = result["stopped_by"]
  if not stopped_by or stopped_by == f"stop_after={args.stop_after}":  # Done, or as planned.
    return 0
  return STOPPED_EXIT_CODES.get(stopped_by, _OTHER_STOP_EXIT_CODE)


def _replayed_record(args: argparse.Namespace):
  """(first phase's config, (record, every phase's config)) for `--replay`; None without it."""
  if not args.replay:
    return None
  from jax_ai_stack.recipes import record

  if not args.workdir:
    raise UsageError("--replay needs --workdir: a new workdir to re-run the record's phases in")
  if args.overrides or args.config or args.preset:
    raise UsageError("--replay takes every config from the record: no preset, --config or "
                     "overrides")
  recorded = record.read(args.replay)
  configs = record.checked_configs(recorded, args.replay)  # All of it, before anything runs.
  return configs[0], (recorded, configs)


def _replay(replayed: tuple[dict, list], run_phase, saved_step: int | None) -> dict:
  """Every phase of the record not yet past `saved_step` (the workdir's newest checkpoint),
  after naming what differs from where it ran."""
  from jax_ai_stack.recipes import record

  recorded, configs = replayed
  differences = record.differences(recorded)
  for line in differences:
    logs.note(line)
  if differences:
    logs.note("the replay runs, but cannot promise the recorded bits")
  return record.replay(recorded, configs, run_phase, saved_step=saved_step)


def _process_index(launch) -> int:
  import jax  # pylint: disable=g-import-not-at-top

  return 0 if launch.mode == "off" else jax.process_index()


def eval_overrides(args: argparse.Namespace) -> list[str]:
  """`args.overrides` as `data.x=v` strings, for `eval` and `quantize`.

  Only data fields and `train.eval_batches` may change: the model is the
  checkpoint's. Says on stderr when the override moves the validation split.

  Raises:
    UsageError: another field, or a value-less override.
  """
  from jax_ai_stack.recipes import configlib

  overrides = configlib.parse_overrides(list(getattr(args, "overrides", None) or []))
  for item in overrides:
    key = item.partition("=")[0]
    if not (key.startswith(_EVAL_OVERRIDE_FIELDS[0]) or key in _EVAL_OVERRIDE_FIELDS[1:]):
      raise UsageError(f"{key}: {args.command} takes data.* overrides and train.eval_batches "
                       "over the run's saved config; the rest is the trained run's")
    if key in ("data.validation_fraction", "data.split_chunk_tokens"):
      logs.note(f"{item} over the run's saved config: the validation split is chosen by hash "
                "below the fraction, so it may now hold text the run trained on")
  return overrides


def run_eval(args: argparse.Namespace) -> int:
  _check_quantized(args)
  logs.status(f"evaluating {args.workdir} ...")  # Before the imports.
  from jax_ai_stack.recipes import compile_cache, progress

  compile_cache.enable()  # "auto": JAX_ENABLE_COMPILATION_CACHE=false turns it off.

  with compile_cache.CompileTimes(announce=progress.Wait):  # Long compiles said as they go.
    if args.tasks:
      from jax_ai_stack.recipes.evaluation import cli as evaluation_cli

      return evaluation_cli.run_harness(
          args, lambda: _open_finished(args, validation=False, method="__call__"))
    with progress.waiting("opening the run"):
      trainer = _open_finished(args, validation=True, method="__call__")
    try:
      with progress.waiting("evaluating"):
        metrics = trainer.evaluate()
    finally:
      trainer.close()
  print(json.dumps({"step": trainer.step, **metrics}, indent=2))
  return 0


def _check_quantized(args: argparse.Namespace) -> None:
  """A `--quantized` that names no scheme stops before anything is printed or loaded."""
  if getattr(args, "quantized", None):
    from jax_ai_stack.recipes.finetune.config import check_scheme

    check_scheme(args.quantized)


def _open_finished(args: argparse.Namespace, *, validation: bool, method: str):
  """The trained run, or with --quantized its quantized parameters (`ptq.open_quantized`)."""
  from jax_ai_stack.recipes.run import build_run

  overrides = eval_overrides(args) if validation else []
  try:
    if not getattr(args, "quantized", None):
      return build_run(None, args.workdir, mode="read", validation=validation,
                       overrides=overrides, environ=os.environ, capture_stderr=True)
    from jax_ai_stack.recipes.finetune import ptq

    return ptq.open_quantized(args.workdir, args.quantized, validation=validation,
                              method=method, overrides=overrides, environ=os.environ,
                              capture_stderr=True)
  except DataError as e:
    raise with_split_hint(e, args) from None


def with_split_hint(error: DataError, args: argparse.Namespace) -> DataError:
  """`error` (a validation split too small for a batch, say) with how `eval` or `quantize`
  gets another split, on the same line."""
  return DataError(f"{error}; the data fields are overrides here too, e.g. jax-ai-stack "
                   f"{args.command} --workdir {args.workdir} data.validation_fraction=0.2 "
                   "data.split_chunk_tokens=128")
