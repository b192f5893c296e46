"""Regenerates pyproject.toml's pins from compat_matrix.yaml.

Run after editing the matrix: `python scripts/sync_pins.py`. With `--check` it
only reports whether pyproject.toml is up to date (exit 1 if not).
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jax_ai_stack import compat  # noqa: E402


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--check", action="store_true", help="report only; exit 1 if stale")
  args = parser.parse_args()
  pyproject = ROOT / "pyproject.toml"
  text = pyproject.read_text(encoding="utf-8")
  block = compat.pyproject_block(compat.load_matrix(ROOT / compat.MATRIX_FILENAME))
  updated = compat.replace_pyproject_block(text, block)
  if updated == text:
    print("pyproject.toml pins match compat_matrix.yaml")
    return 0
  if args.check:
    print("pyproject.toml pins differ from compat_matrix.yaml: run scripts/sync_pins.py")
    return 1
  pyproject.write_text(updated, encoding="utf-8")
  print("pyproject.toml pins regenerated from compat_matrix.yaml")
  return 0


if __name__ == "__main__":
  sys.exit(main())
