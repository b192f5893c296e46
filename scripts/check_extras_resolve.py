"""Checks that pip resolves each accelerator row of compat_matrix.yaml to its pins.

  python scripts/check_extras_resolve.py                 # every cuda12/cuda13/tpu row
  python scripts/check_extras_resolve.py --row py3.12-tpu

The CI machine has no GPU or TPU, so these rows cannot be installed and tested
there; what it can check is that `pip install ".[cuda12]"` (with each optional
extra that holds a package of the row, so that every one is asked for) resolves, for that row's
Python, to exactly the versions the row names. It asks pip for a dry-run report
with the row's interpreter (pyenv's), downloading metadata only. A row whose
Python pyenv lacks is skipped. Exit status: 0 every checked row resolves to its
pins, 1 a row does not (each mismatch names the package), 2 bad input.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import sys
import time
from collections.abc import Mapping

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from propose_row import ROOT, ResolutionError, pip_report, pyenv_interpreter, report_versions  # noqa: E402

from jax_ai_stack import compat  # noqa: E402


def requirement(matrix: compat.Matrix, row: compat.Row, project: pathlib.Path = ROOT) -> str:
  """`<project>[<accelerator>,<extras>]`: the install that asks for every package of `row`.

  Only the extras with a package in the row: one that the row does not pin (a
  benchmark-only torch) would be resolved and downloaded for nothing.
  """
  extras = [row.accelerator] if row.accelerator != "cpu" else []
  extras += sorted(e for e, names in matrix.extras.items() if set(names) & set(row.packages))
  return f"{project}[{','.join(extras)}]"


def mismatches(row: compat.Row, resolved: Mapping[str, str]) -> list[str]:
  """One line per package of `row` that the resolution leaves out or pins differently."""
  problems = []
  for name, pinned in sorted(row.packages.items()):
    got = resolved.get(name)
    if got is None:
      problems.append(f"{name}: pinned {pinned}, not in the resolution")
    elif got != pinned:
      problems.append(f"{name}: pinned {pinned}, pip resolves {got}")
  return problems


def check_row(matrix: compat.Matrix, row: compat.Row, interpreter: pathlib.Path) -> list[str]:
  """The mismatches of one row (a failed resolution is one problem naming pip's error)."""
  try:
    report = pip_report(interpreter, [requirement(matrix, row)])
  except ResolutionError as e:
    return [str(e)]
  return mismatches(row, report_versions(report))


def _check_timed(matrix: compat.Matrix, row: compat.Row) -> tuple[list[str], float] | None:
  """(mismatches, seconds) of one row; None when pyenv has no interpreter for it."""
  interpreter = pyenv_interpreter(row.python)
  if interpreter is None:
    return None
  started = time.monotonic()
  return check_row(matrix, row, interpreter), time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--row", action="append", help="a row name (repeatable); default: "
                                                     "every accelerator row")
  parser.add_argument("--matrix", default=str(ROOT / compat.MATRIX_FILENAME))
  parser.add_argument("--jobs", type=int, default=3,
                      help="rows resolved at once (pip mostly waits on downloads)")
  args = parser.parse_args(argv)
  try:
    matrix = compat.load_matrix(args.matrix)
  except compat.MatrixError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  names = {r.name for r in matrix.rows}
  unknown = sorted(set(args.row or ()) - names)
  if unknown:
    print(f"error: no row named {', '.join(unknown)}; rows: {', '.join(sorted(names))}",
          file=sys.stderr)
    return 2
  rows = [r for r in matrix.rows if (r.name in args.row if args.row else r.accelerator != "cpu")]
  with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
    results = [pool.submit(_check_timed, matrix, row) for row in rows]
    failed = False
    for row, result in zip(rows, results):  # In matrix order; pip runs meanwhile.
      outcome = result.result()
      if outcome is None:
        print(f"{row.name}: SKIPPED (no Python {row.python} under pyenv)", flush=True)
        continue
      problems, seconds = outcome
      if problems:
        failed = True
        print(f"{row.name}: FAIL ({seconds:.0f}s)", flush=True)
        for problem in problems:
          print(f"  {problem}", flush=True)
      else:
        print(f"{row.name}: PASS ({len(row.packages)} packages resolve to the row's pins, "
              f"{seconds:.0f}s)", flush=True)
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
