"""What every benchmark script shares: the header of its record, --out, the JSON write, and
timing variants in interleaved rounds.

The scripts run as `python benchmarks/<name>.py`, which puts this folder on
`sys.path`, so they `import common`; tests/test_benchmarks.py puts the folder
there too before it loads a script.

Example:
  >>> header("demo", device=False)["benchmark"]
  'demo'
  >>> verdict(1.82, 1.0)
  'MISSED by 82.0%'
  >>> verdict(0.45, 0.9, at_least=True)
  'MISSED by 50.0%'
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

RESULTS_DIR = pathlib.Path(__file__).parent / "results"
"""Where each benchmark writes `<name>.json` by default (gitignored)."""


def header(name: str, *, device: bool = True) -> dict[str, Any]:
  """The first keys of every record: which benchmark, on what, with which versions.

  Args:
    name: the benchmark's name, also its default file name.
    device: whether to name JAX's first device and version (imports jax and
      starts its backend); False for benchmarks that leave JAX to subprocesses.
  """
  record = {"benchmark": name, "python": platform.python_version()}
  if device:
    import jax  # pylint: disable=g-import-not-at-top

    first = jax.devices()[0]
    record.update(device=f"{first.platform}: {first.device_kind}", jax=jax.__version__)
  return record


def target(value: float, limit: float, *, at_least: bool = False) -> dict[str, Any]:
  """A figure judged against its target: the record's form of it.

  Lower is better, unless `at_least` (a throughput or an MFU, which must reach
  the limit). "missed_by" is how far the figure is on the wrong side of the
  limit, as a fraction of the limit (0.82: 82% over; 0.5: half of it short),
  so that a missed target says by how much.
  """
  if at_least:
    return {"value": value, "target": limit, "at_least": True, "met": value >= limit,
            "missed_by": max(1 - value / limit, 0.0)}
  return {"value": value, "target": limit, "met": value <= limit,
          "missed_by": max(value / limit - 1, 0.0)}


def verdict(value: float, limit: float, *, at_least: bool = False) -> str:
  """'met' if value is on the right side of limit, else by how much not: 'MISSED by 82.0%'."""
  judged = target(value, limit, at_least=at_least)
  return "met" if judged["met"] else f"MISSED by {judged['missed_by']:.1%}"


def versions() -> dict[str, Any]:
  """jaxlib, JAX's accelerator plugins and torch, as installed (nothing is imported).

  Plugins are the `jax-cuda*` / `jax-rocm*` / `libtpu` distributions; torch is
  None where it is not installed.
  """
  def version(name: str) -> str | None:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None

  plugins = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name.startswith(("jax-cuda", "jax-rocm", "libtpu")):
      plugins[name] = dist.version
  return {"jaxlib": version("jaxlib"), "jax_plugins": dict(sorted(plugins.items())),
          "torch": version("torch")}


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
  """`--out PATH`, by default results/<name>.json."""
  default = RESULTS_DIR / f"{name}.json"
  parser.add_argument("--out", type=pathlib.Path, default=default,
                      help=f"where to write the JSON (default: {default})")


def write(results: dict[str, Any], out: pathlib.Path) -> None:
  """Writes the record as indented JSON, making the folder if needed, and says where."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(results, indent=2) + "\n")
  print(f"wrote {out}")


def interleaved_ms(calls: Mapping[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
  """{name: ms of each round} of each call (already compiled), its result waited for.

  The calls take turns to go first, round by round, so that noise from other
  processes hits them alike.
  """
  import jax  # pylint: disable=g-import-not-at-top

  names = list(calls)
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      started = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(1e3 * (time.perf_counter() - started))
  return times


def positive_int(text: str) -> int:
  """argparse type: an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return value


def non_negative_float(text: str) -> float:
  """argparse type: a number >= 0 (NaN refused)."""
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value >= 0:
    raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
  return value
