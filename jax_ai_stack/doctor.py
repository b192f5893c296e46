"""`jax-ai-stack doctor` and `jax-ai-stack constraints`.

doctor answers "is what I have installed a set that was tested together?";
constraints answers "how do I pin that set in my own project?".

Example:
  >>> import argparse
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args = parser.parse_args(["constraints", "--python", "3.12", "--accelerator", "cpu"])
  >>> args.func(args)  # doctest: +ELLIPSIS
  # jax-ai-stack ...: tested set py3.12-cpu (Python 3.12, cpu)
  # Use: pip install -c constraints.txt <your packages>
  ...
  numpy==...
  ...
  0
  >>> args = parser.parse_args(["doctor", "--json"])
  >>> args.func.__name__, args.json, args.strict
  ('run_doctor', True, False)
  >>> sorted(jax_backend())
  ['backend', 'devices']
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from jax_ai_stack import compat
from jax_ai_stack.errors import UsageError


def register(subparsers) -> None:
  doctor = subparsers.add_parser(
      "doctor", help="compare installed packages with the tested matrix row"
  )
  doctor.add_argument("--strict", action="store_true",
                      help="exit 2 on any difference, naming each package")
  doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
  doctor.add_argument("--matrix", help="matrix file (default: the one shipped)")
  doctor.set_defaults(func=run_doctor)

  constraints = subparsers.add_parser(
      "constraints", help="print a pip constraints file for a tested row"
  )
  constraints.add_argument("--python", help="Python version X.Y (default: the running one)")
  constraints.add_argument(
      "--accelerator", help=f"one of {', '.join(compat.ACCELERATORS)} (default: cpu)"
  )
  constraints.add_argument("--matrix", help="matrix file (default: the one shipped)")
  constraints.set_defaults(func=run_constraints)


def _load(path: str | None) -> compat.Matrix:
  try:
    return compat.load_matrix(path)
  except compat.MatrixError as e:
    raise UsageError(str(e)) from None


def _row(matrix: compat.Matrix, python: str | None, accelerator: str | None) -> compat.Row:
  try:
    return compat.find_row(matrix, python, accelerator)
  except compat.RowNotFoundError as e:
    raise UsageError(str(e)) from None


def jax_backend() -> dict:
  """JAX's default backend and devices, or the import error if JAX is broken."""
  try:
    import jax

    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
  except Exception as e:  # noqa: BLE001 - the doctor reports whatever went wrong.
    return {"backend": None, "devices": [], "error": f"{type(e).__name__}: {e}"}


def run_doctor(args: argparse.Namespace) -> int:
  matrix = _load(args.matrix)
  row = _row(matrix, None, None)
  statuses = compat.compare(matrix, row)
  backend = jax_backend()
  report = {
      "python": platform.python_version(),
      "row": row.name,
      "matrix": matrix.source,
      "packages": [
          {"name": s.name, "pinned": s.pinned, "installed": s.installed, "status": s.status}
          for s in statuses
      ],
      "jax": backend,
      "limitations": list(row.limitations),
      "upstream": ({"version": matrix.upstream.version, "pins": matrix.upstream.pins}
                   if matrix.upstream else None),
  }
  if args.json:
    print(json.dumps(report, indent=2))
  else:
    _print_table(report)
    _print_differences(report)

  missing = [s for s in statuses if s.status == "missing"]
  for s in missing:
    print(
        f"error: required package {s.name} is not installed (row {row.name} pins"
        f" {s.name}=={s.pinned}); reinstall with: pip install 'jax-ai-stack'",
        file=sys.stderr,
    )
  different = [s for s in statuses if s.status == "different"] if args.strict else []
  for s in different:
    print(f"error: {s.name} {s.installed} is installed; row {row.name} pins "
          f"{s.name}=={s.pinned}", file=sys.stderr)
  if different:
    print(f"error: {len(different)} package(s) differ from the tested set: "
          + _MOVE + " ".join(s.name for s in different),
          file=sys.stderr)
  return 2 if missing or different else 0


_MOVE = "jax-ai-stack constraints > constraints.txt && pip install -c constraints.txt "


def _print_differences(report: dict) -> None:
  """The packages at another version than the row's, and what the row gives instead; where
  upstream's jax-ai-stack pins the version found, it says so (a move from upstream)."""
  different = [p for p in report["packages"] if p["status"] == "different"]
  if not different:
    return
  upstream = report["upstream"] or {"version": None, "pins": {}}
  print()
  print(f"Differs from row {report['row']} ({len(different)}): what the row gives instead")
  width = max(len(p["name"]) for p in different)
  print(f"{'package':<{width}}  {'installed':<10}  {'row gives':<10}  installed by")
  for p in different:
    pinned_upstream = upstream["pins"].get(p["name"]) == p["installed"]
    origin = f"upstream's jax-ai-stack {upstream['version']}" if pinned_upstream else ""
    print(f"{p['name']:<{width}}  {p['installed']:<10}  {p['pinned']:<10}  {origin}".rstrip())
  print("Move to the row: " + _MOVE + " ".join(p["name"] for p in different))


def _print_table(report: dict) -> None:
  print(f"Python      {report['python']}")
  print(f"Matrix row  {report['row']}  ({report['matrix']})")
  jax_info = report["jax"]
  if jax_info.get("error"):
    print(f"JAX         import failed: {jax_info['error']}")
  else:
    print(f"JAX         backend {jax_info['backend']}, devices {', '.join(jax_info['devices'])}")
  print()
  width = max(len(p["name"]) for p in report["packages"])
  print(f"{'package':<{width}}  {'pinned':<10}  {'installed':<10}  status")
  for p in report["packages"]:
    installed = p["installed"] or "-"
    status = "not installed (optional)" if p["status"] == "absent" else p["status"]
    print(f"{p['name']:<{width}}  {p['pinned']:<10}  {installed:<10}  {status}")
  counts = {}
  for p in report["packages"]:
    label = "not installed (optional)" if p["status"] == "absent" else p["status"]
    counts[label] = counts.get(label, 0) + 1
  print()
  print("Summary     " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
  if report["limitations"]:
    print("Known limitations of this row:")
    for text in report["limitations"]:
      print(f"  - {text}")


def run_constraints(args: argparse.Namespace) -> int:
  matrix = _load(args.matrix)
  accelerator = args.accelerator or "cpu"
  if accelerator not in compat.ACCELERATORS:
    raise UsageError(
        f"unknown --accelerator {accelerator!r}; choose one of {', '.join(compat.ACCELERATORS)}"
    )
  row = _row(matrix, args.python, accelerator)
  sys.stdout.write(compat.constraints_text(row))
  return 0
