"""Phases: a run resumed with other settings goes on from its step under them, recorded.

A resumed run whose config differs from the one its checkpoint was trained with
starts a new phase at the checkpoint's step: the steps before keep their bits,
the steps after follow the new settings, and every checkpoint lists the phases
so far (each one's first step and the config it was given). What a phase may
change: the data (a corpus, a mixture's components and weights), the
learning-rate schedule and the optimizer's other settings, `train.steps`,
evaluation and saving, the mesh, and how the model runs (`attention_impl`,
`remat`, `scan_layers`). Anything else makes it another run, and is refused
naming the field (`FROZEN`): the model, the tokenizer, `data.seq_len`,
`data.packing`, `data.batch_size`, the optimizer's kind and accumulation,
`train.seed`, fine-tuning and quantization. Settings that change no bit
(`QUIET`: the progress bar, the log cadence, the compile cache, a profile,
data workers) start no phase.

A mixture's stages compose across phases: the stages of the phases before keep
the rows they dealt, and the new phase's weights apply from its first step (its
stage in force at that step starts there; its later stages keep their steps).
So a run stopped at a stage boundary and resumed with the next stage's weights
deals the same rows as one that planned both stages, and its components read
on from where they were (`data.mixture`'s positions are counted per name).

Example: a run resumed at step 100 with a cooldown mixture.
  >>> before = {"train": {"steps": 100, "seed": 0}}
  >>> now = {"train": {"steps": 150, "seed": 0}}
  >>> changes(before, now)
  [('train.steps', 100, 150)]
  >>> refused(changes(before, {"train": {"steps": 100, "seed": 1}}))
  [('train.seed', 0, 1)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from jax_ai_stack.errors import ConfigError

FROZEN = ("model.", "finetune.", "quant.", "train.seed", "data.tokenizer", "data.tokenizer_path",
          "data.seq_len", "data.packing", "data.batch_size", "optim.name",
          "optim.accumulate_steps")
"""Fields (or section prefixes) a resumed run keeps: changing one makes another run."""
MODEL_RUNS = ("model.attention_impl", "model.remat", "model.scan_layers")
"""How the model runs, not what it is: a phase may change these."""
QUIET = ("name", "train.progress", "train.compile_cache", "train.log_every", "train.profile",
         "train.resume", "data.num_workers", "data.prefetch_batches")
"""Settings that change no bit of the run: changing them starts no phase."""

_ABSENT = object()


def changes(saved: dict, current: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
  """(dotted field, saved value, current value) of each leaf that differs; a field only
  one of them has (a config written before the field existed) is no change."""
  return list(_changes(saved, current, prefix))


def _changes(saved: dict, current: dict, prefix: str) -> Iterator[tuple[str, Any, Any]]:
  for key in sorted(saved.keys() | current.keys()):
    a, b = saved.get(key, _ABSENT), current.get(key, _ABSENT)
    if isinstance(a, dict) and isinstance(b, dict) and key != "mixture":
      yield from _changes(a, b, f"{prefix}{key}.")
    elif a is not _ABSENT and b is not _ABSENT and a != b:
      yield f"{prefix}{key}", a, b


def refused(found: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
  """The changes a new phase cannot make (`FROZEN`, but for `MODEL_RUNS`)."""
  return [c for c in found if c[0] not in MODEL_RUNS
          and any(c[0] == f or (f.endswith(".") and c[0].startswith(f)) for f in FROZEN)]


def phase_changes(found: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
  """The changes that start a phase (all but `QUIET`)."""
  return [c for c in found if c[0] not in QUIET]


def describe(found: list[tuple[str, Any, Any]]) -> str:
  """`field a -> b` for each change (`field changed` for a group such as a mixture)."""
  return ", ".join(f"{field} changed" if isinstance(b, (dict, list)) else f"{field} {a!r} -> {b!r}"
                   for field, a, b in found)


def refusal(found: list[tuple[str, Any, Any]], workdir: Any) -> ConfigError:
  """The one-line error for changes a resumed run cannot make."""
  named = "; ".join(f"{field}: {a!r} in the run, {b!r} now" for field, a, b in found)
  return ConfigError(
      f"{named}: a run in {workdir} keeps its model, tokenizer, sequence length, batch size, "
      "seed and fine-tuning when it resumes (a new phase may change the data, the batch size "
      "through data.batch_schedule, the learning-rate schedule, train.steps, evaluation, saving "
      "and the mesh); train in a new --workdir "
      f"(finetune.base={workdir} starts from this run's weights)")


def history(metadata: dict) -> list[dict]:
  """The phases a checkpoint lists ({"step", "config"}: the config each was given); a
  checkpoint from before phases has one, from step 0, with its config."""
  return list(metadata.get("phases") or [{"step": 0, "config": metadata.get("config", {})}])


def effective(given: dict, phases: list[dict], start: int) -> dict:
  """The config a phase that `given` begins at step `start` runs with: `given`, its
  mixture's stages and batch schedule composed with those of the phases before (see
  the module)."""
  data = given.get("data")
  if data is None:
    return given
  ends = [p["step"] for p in phases[1:]] + [start]
  if data.get("batch_schedule") is not None or any(
      p["config"].get("data", {}).get("batch_schedule") for p in phases):
    spans = [(p["config"]["data"], p["step"], end) for p, end in zip(phases, ends)]
    data = {**data, "batch_schedule": _compose_batches([*spans, (data, start, None)])}
  if data.get("mixture") is not None:
    composed = None
    for phase, end in zip(phases, ends):
      earlier = phase["config"].get("data", {}).get("mixture")
      composed = None if earlier is None else _compose(composed, earlier, phase["step"], end)
    data = {**data, "mixture": _compose(composed, data["mixture"], start, None)}
  return given if data == given["data"] else {**given, "data": data}


def _compose_batches(spans: list[tuple[dict, int, int | None]]) -> list[dict]:
  """The batch schedule of phases that each ran their data config from one step to the
  next: each phase's size in force at its first step, then its entries up to its end."""
  entries, size = [], spans[0][0]["batch_size"]
  for data, begin, end in spans:
    steps = [begin] + [e["step"] for e in data.get("batch_schedule") or ()
                       if begin < e["step"] and (end is None or e["step"] < end)]
    for step in steps:
      if (now := _batch_size_at(data, step)) != size:
        entries.append({"step": step, "batch_size": now})
        size = now
  return entries


def _batch_size_at(data: dict, step: int) -> int:
  """Global rows of step `step` under one `data` config (its batch schedule)."""
  size = data["batch_size"]
  for entry in data.get("batch_schedule") or ():
    if entry["step"] <= step:
      size = entry["batch_size"]
  return size


def _compose(before: dict | None, mixture: dict, start: int, end: int | None) -> dict:
  """`before`'s stages up to `start`, then `mixture`'s from `start` (up to `end`).

  With no mixture before (a single corpus until `start`), the stage in force at
  `start` counts from step 0: its components begin their streams that far in.
  """
  stages = [dict(s) for s in mixture["stages"]]
  in_force = [s for s in stages if s["step"] <= start][-1]
  after = [s for s in stages if start < s["step"] and (end is None or s["step"] < end)]
  kept = [] if before is None else [s for s in before["stages"] if s["step"] < start]
  head = [] if kept and _same(kept[-1]["weights"], in_force["weights"]) else [
      {**in_force, "step": start if before is not None else 0}]
  components = {**(before or {}).get("components", {}), **mixture["components"]}
  return {"components": components, "stages": kept + head + after}


def _same(a: dict, b: dict) -> bool:
  """Whether two stages' weights deal the same shares."""
  total_a, total_b = sum(a.values()), sum(b.values())
  names = set(a) | set(b)
  return all(a.get(n, 0) / total_a == b.get(n, 0) / total_b for n in names)


@dataclasses.dataclass(frozen=True)
class Resumed:
  """What resuming settled: the config to run, the phases, and what started a new one."""

  config: dict
  """The effective config (mixture stages composed across phases)."""
  phases: list[dict]
  """Every phase so far, the current one last."""
  started: list[tuple[str, Any, Any]]
  """The changes that began a new phase at this step; [] when the phase goes on."""
  basis: list[dict]
  """The phases the checkpoint listed (what the restore must find again)."""


def resume(metadata: dict, given: dict, workdir: Any) -> Resumed:
  """The phases of a run resumed at the checkpoint whose `metadata` is given, with the
  config `given` now (as dicts).

  Raises:
    ConfigError: `given` changes a field a resumed run keeps (naming each).
  """
  step = int(metadata.get("step", 0))
  phases = history(metadata)
  if step == 0:  # Nothing trained yet (import-hf's step 0): the config is the run's first.
    return Resumed(effective(given, [], 0), [{"step": 0, "config": given}], [], phases)
  found = changes(phases[-1]["config"], given)
  if bad := refused(found):
    raise refusal(bad, workdir)
  started = phase_changes(found)
  if started:
    if phases[-1]["step"] == step:  # Changed again at the step its phase began: replace it.
      phases = phases[:-1]
    phases = [*phases, {"step": step, "config": given}]
  return Resumed(effective(phases[-1]["config"], phases[:-1], phases[-1]["step"]), phases,
                 started, history(metadata))


__all__ = ["FROZEN", "MODEL_RUNS", "QUIET", "Resumed", "changes", "describe", "effective",
           "history", "phase_changes", "refusal", "refused", "resume"]
