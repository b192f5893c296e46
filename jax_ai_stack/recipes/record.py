"""The run record: `WORKDIR/record.json`, each phase of a run and what it ran on; replay.

For each phase (`phases`): the step it began at, the config it was given, the
exact package versions (the matrix row's packages, as `doctor` reads them), the
backend, device and process counts, the attention kernel chosen, and a
fingerprint (size and content hash) of every data file the phase reads. The
first process writes it when a run opens and when a phase begins.

`jax-ai-stack train --replay RECORD --workdir NEW` (`replay`) trains each phase
in turn, stopping where the next began, so a run that went through several
phases is re-run from its record alone; on the same backend it ends with
bitwise the same parameters. Before it starts, the whole record is checked
(`checked_configs`: each phase's step, their order, each config complete and
valid) and each difference from where it ran (a package version, a data file,
the backend or the device count) is named.

Fingerprints: a file's hash is computed once; a later record keeps it while the
file's size and modification time are unchanged (as the token cache does).

Example: what is not a record is refused, naming the file.
  >>> _ = open("r.json", "w").write("{}")
  >>> read("r.json")
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.UsageError: r.json: not a run record of format 1 with phases
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from jax_ai_stack import compat
from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.config import RecipeConfig
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data import sources as data_sources
from jax_ai_stack.recipes.data.token_cache import identity

RECORD_FILE = "record.json"
FORMAT = 1


def versions() -> dict[str, Any]:
  """Python, the matrix row it matches (None: none), and each package's installed version."""
  matrix = compat.load_matrix()
  try:
    row = compat.find_row(matrix)
  except compat.RowNotFoundError:
    row = None
  names = sorted(row.packages if row else {n for r in matrix.rows for n in r.packages})
  installed = {name: compat.installed_version(name) for name in names}
  return {"python": compat.running_python(), "row": row.name if row else None,
          "packages": {name: version for name, version in installed.items() if version}}


def data_files(data: DataConfig, recorded: list[dict] | None = None) -> list[dict]:
  """Path, size, mtime and content hash of each file the data reads (each component's);
  a file whose size and mtime match its `recorded` entry keeps the recorded hash."""
  sources = ([data.component(name) for name in data.mixture.components] if data.mixture
             else [data])
  files = sorted({path for source in sources
                  if source.is_token_source or source.is_preference or source.is_prompts
                  for path in data_sources.source_files(source)})
  return identity.file_entries(files, recorded)


def read(path: str | pathlib.Path) -> dict:
  """A record file, checked; UsageError naming the file when it is not one."""
  path = pathlib.Path(path)
  try:
    record = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise UsageError(f"{path}: not a run record ({type(e).__name__}: {e})") from None
  if not isinstance(record, dict) or record.get("format") != FORMAT or not record.get("phases"):
    raise UsageError(f"{path}: not a run record of format {FORMAT} with phases")
  return record


def checked_configs(record: dict, path: str | pathlib.Path) -> list[RecipeConfig]:
  """Each phase's config of `record`, validated, before anything runs: UsageError (one line
  naming the file, the phase and the field) for a phase without its step, phases out of
  order, or a config that is incomplete (a section or field removed: it would run on a
  default the phase never had) or invalid."""
  configs, last = [], None
  for i, phase in enumerate(record["phases"], start=1):
    where = f"{path}: phase {i}"
    step = phase.get("step") if isinstance(phase, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise UsageError(f"{where} has no \"step\" (the step it began at, a whole number >= 0)")
    if last is None and step != 0:
      raise UsageError(f"{where} begins at step {step}: a run's first phase begins at step 0")
    if last is not None and step <= last:
      raise UsageError(f"{where} begins at step {step}, not after phase {i - 1} (step {last}): "
                       "a record lists its phases in the order they ran")
    if not isinstance(phase.get("config"), dict):
      raise UsageError(f"{where} (from step {step}) has no \"config\"")
    config = configlib.from_dict(RecipeConfig, phase["config"],
                                 source=f"{where} (from step {step})")
    missing = _missing(configlib.to_dict(config), phase["config"])
    if missing:
      more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
      raise UsageError(f"{where} (from step {step}): its config has no {', '.join(missing[:3])}"
                       f"{more}; a record holds every field a phase ran with, so a replay "
                       "never runs on a default the phase did not have: restore them")
    configs.append(config)
    last = step
  return configs


def _missing(full: dict, given: dict, prefix: str = "") -> list[str]:
  """Dotted names of `full`'s fields that `given` lacks (a whole section by its name)."""
  found = []
  for key, value in full.items():
    if key not in given:
      found.append(f"{prefix}{key}")
    elif isinstance(value, dict) and isinstance(given[key], dict):
      found += _missing(value, given[key], f"{prefix}{key}.")
  return found


def update(run: Any) -> dict:
  """`run`'s record, written into its workdir: each phase as the record had it, a new
  one (or one whose config changed at its first step) described now."""
  path = pathlib.Path(run.workdir) / RECORD_FILE
  old = read(path)["phases"] if path.exists() else []
  phases = [old[i] if i < len(old) and _same_phase(old[i], phase) else _describe(run, phase)
            for i, phase in enumerate(run.phases)]
  record = {"format": FORMAT, "phases": phases}
  write_atomically(path, json.dumps(record, indent=1) + "\n")
  return record


def _same_phase(recorded: dict, phase: dict) -> bool:
  return recorded.get("step") == phase["step"] and recorded.get("config") == phase["config"]


def _describe(run: Any, phase: dict) -> dict:
  choice = run.attention_choice
  return {
      "step": phase["step"],
      "config": phase["config"],
      "versions": versions(),
      "backend": jax.default_backend(),
      "devices": jax.device_count(),
      "processes": jax.process_count(),
      "attention": choice.name if choice is not None else None,
      "data_files": data_files(_data(phase)),
  }


def _data(phase: dict) -> DataConfig:
  """The data section of a phase's config (only it: a family of one's own validates too)."""
  return configlib.from_dict(DataConfig, phase["config"].get("data", {}), source="a phase's data")


def differences(record: dict) -> list[str]:
  """What differs here from where each phase of `record` ran: versions, data files,
  backend, device count (one line each, the phase named)."""
  found = []
  now_versions, backend, devices = versions(), jax.default_backend(), jax.device_count()
  for i, phase in enumerate(record["phases"], start=1):
    where = f"phase {i} (from step {phase['step']})"
    then = phase.get("versions", {})
    if then.get("python") != now_versions["python"]:
      found.append(f"{where}: Python {then.get('python')} then, {now_versions['python']} now")
    for name, version in sorted(then.get("packages", {}).items()):
      if now_versions["packages"].get(name) != version:
        found.append(f"{where}: {name} {version} then, "
                     f"{now_versions['packages'].get(name, 'not installed')} now")
    if phase.get("backend") != backend or phase.get("devices") != devices:
      found.append(f"{where}: {phase.get('devices')} {phase.get('backend')} device(s) then, "
                   f"{devices} {backend} now")
    recorded = {e["path"]: e for e in phase.get("data_files", [])}
    try:
      current = {e["path"]: e for e in data_files(_data(phase), list(recorded.values()))}
    except (OSError, ValueError) as e:
      found.append(f"{where}: its data does not read here ({e})")
      continue
    for path in sorted(recorded.keys() | current.keys()):
      a, b = recorded.get(path), current.get(path)
      if a is None or b is None or a["blake2b"] != b["blake2b"]:
        state = "missing" if b is None else "new" if a is None else "changed"
        found.append(f"{where}: data file {path} {state}")
  return found


def replay(record: dict, configs: list[RecipeConfig],
           train_phase: Callable[..., dict], *, saved_step: int | None = None) -> dict:
  """Trains each phase of `record` in turn, with its `configs` (`checked_configs`):
  `train_phase(config, stop_after=...)` (a `train.run` with its workdir), stopping at
  the step where the next phase began. Returns the last phase's result (a stop by a
  signal ends the replay there).

  `saved_step`: the workdir's newest checkpoint (an interrupted replay run again); the
  phases that ended by it are passed over, so none runs on a later phase's state.
  """
  phases = record["phases"]
  result: dict = {}
  for i, config in enumerate(configs):
    stop = phases[i + 1]["step"] if i + 1 < len(phases) else None
    if stop is not None and saved_step is not None and saved_step >= stop:
      continue
    result = train_phase(config, stop_after=stop)
    if result.get("stopped_by") and result["stopped_by"] != f"stop_after={stop}":
      return result  # Stopped by a signal: run the replay again to go on.
    if stop is not None:
      print(f"replay: phase {i + 1} of {len(phases)} ended at step {stop}; phase {i + 2} "
            "begins", flush=True)
  return result
