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


def run_on_devices(code: str, devices: int = 8, timeout: int = 600) -> object:
  """Runs `code` with `devices` CPU devices; returns the JSON its last line prints."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout)
  if result.returncode != 0:
    raise AssertionError(f"the {devices}-device snippet failed:\n{result.stdout}\n{result.stderr}")
  return json.loads(result.stdout.strip().splitlines()[-1])
