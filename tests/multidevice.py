"""Runs a snippet of Python on N simulated CPU devices, in a subprocess.

The rest of the suite keeps its one device: JAX fixes the device count when it
starts, so a test that needs a mesh runs its body in a fresh interpreter with
`JAX_NUM_CPU_DEVICES` set and reads back what the body prints as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_on_devices(code: str, devices: int = 8, timeout: int = 600, *,
                   with_stderr: bool = False) -> object:
  """Runs `code` with `devices` CPU devices; returns the JSON its last line prints (and,
  `with_stderr`, what it wrote to stderr: XLA's C++ warnings go there, past Python; the
  persistent compilation cache is then off, since a program read from it is not
  compiled and warns of nothing)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  if with_stderr:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout)
  if result.returncode != 0:
    raise AssertionError(f"the {devices}-device snippet failed:\n{result.stdout}\n{result.stderr}")
  printed = json.loads(result.stdout.strip().splitlines()[-1])
  return (printed, result.stderr) if with_stderr else printed
