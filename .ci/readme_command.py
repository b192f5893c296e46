"""Prints one of README.md's two commands, so CI runs exactly what users read.

Usage: python3 .ci/readme_command.py main|test
The command is the fenced block that follows `<!-- command: NAME -->`.
"""

import pathlib
import re
import sys

name = sys.argv[1]
readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
match = re.search(rf"<!-- command: {name} -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S)
if not match:
  sys.exit(f"README.md has no command block marked <!-- command: {name} -->")
print(match.group(1).strip())
