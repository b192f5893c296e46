"""PyTorch's side of `train_step.py --torch`, in a process of its own.

So that PyTorch's threads never share a process with JAX's (in one process
its step measured 10-37% slower on a quiet 2-core CPU; benchmarks/README.md),
the parent (train_step.py, which imports JAX) never imports torch: it starts
this file as a child, which builds the PyTorch trainers (`torch_llama.py`)
from the JAX model's initial parameters, then runs and times what the parent
asks, one request at a time. The parent blocks, idle, on each reply, so its
rounds stay interleaved with the JAX variants and the two runtimes never
compute at the same time.

The parent writes `params.npz` (the JAX parameters, {'a/b/c': array}),
`batch.npz` and `spec.json` (model and optimizer fields, the variants,
"threads" for `torch.set_num_threads`, or null, and optionally "device":
"cpu", the default, or "cuda") to a directory and runs
`python torch_process.py DIR`. Then one JSON object per line: requests on the
child's stdin, replies on a private copy of its stdout (fd 1 itself goes to
stderr, so that prints and warnings from torch cannot break the stream):

  (on start)                                  -> {"torch": version, "threads": n, "device": d}
  {"op": "run", "variant": v, "steps": n}     -> {"seconds": s, "loss": l}
  {"op": "first_loss"}                        -> {"loss": l}  (float32 eager, no step)
  {"op": "parts", "variant": v}               -> {"parts": [names]}  (builds, warms up)
  {"op": "part", "variant": v, "part": p}     -> {"seconds": s}

A failed request is answered {"error": traceback}; the parent raises it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Any

import numpy as np


WARMUP_CALLS = 3
"""Calls of each part before it is timed, on both sides (train_step.jax_components too)."""


class TorchProcess:
  """The parent's handle on the child: `call(op=..., ...)` returns its reply."""

  def __init__(self, spec: dict[str, Any], params: dict[str, np.ndarray],
               batch: dict[str, np.ndarray]):
    self._directory = tempfile.TemporaryDirectory(prefix="jax_ai_stack_torch_")
    directory = pathlib.Path(self._directory.name)
    np.savez(directory / "params.npz", **params)
    np.savez(directory / "batch.npz", **{k: np.asarray(v) for k, v in batch.items()})
    (directory / "spec.json").write_text(json.dumps(spec))
    # The child finds torch and this folder where the parent does.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    self._process = subprocess.Popen(
        [sys.executable, __file__, str(directory)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=env, text=True)
    try:
      self.info = self._read()
    except BaseException:
      self.close()
      raise

  def call(self, **request: Any) -> dict[str, Any]:
    self._process.stdin.write(json.dumps(request) + "\n")
    self._process.stdin.flush()
    return self._read()

  def _read(self) -> dict[str, Any]:
    line = self._process.stdout.readline()
    if not line:
      raise RuntimeError(f"the PyTorch process exited (code {self._process.wait()}); "
                         "its errors are above")
    reply = json.loads(line)
    if "error" in reply:
      raise RuntimeError(f"in the PyTorch process:\n{reply['error']}")
    return reply

  def close(self) -> None:
    if self._process.poll() is None:
      self._process.stdin.close()  # The child's loop ends at end of input.
      self._process.wait(timeout=60)
    self._directory.cleanup()

  def __enter__(self) -> TorchProcess:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def serve(directory: pathlib.Path) -> None:
  """The child: builds the trainers, then answers requests until stdin closes."""
  replies = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  import torch  # pylint: disable=g-import-not-at-top
  import torch_llama  # pylint: disable=g-import-not-at-top

  spec = json.loads((directory / "spec.json").read_text())
  if spec.get("threads"):
    torch.set_num_threads(spec["threads"])
  device = spec.get("device", "cpu")
  if device == "cuda" and not torch.cuda.is_available():
    replies.write(json.dumps({"error": f"torch {torch.__version__} has no CUDA device"}) + "\n")
    return
  config = types.SimpleNamespace(**spec["model"])
  optim_config = types.SimpleNamespace(**spec["optim"])
  params = dict(np.load(directory / "params.npz"))
  batch = dict(np.load(directory / "batch.npz"))
  trainers = {
      name: torch_llama.Trainer(config, params, batch, optim_config, spec["total_steps"],
                                compiled=compiled, bf16=bf16, device=device)
      for name, (compiled, bf16) in spec["variants"].items()
  }
  shape = types.SimpleNamespace(batch_size=batch["inputs"].shape[0],
                                seq_len=batch["inputs"].shape[1])
  parts: dict[str, dict[str, Any]] = {}

  def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

  def handle(request: dict[str, Any]) -> dict[str, Any]:
    op, variant = request["op"], request.get("variant")
    if op == "run":
      start = time.perf_counter()
      loss = trainers[variant].run(request["steps"])
      if device == "cuda":
        torch.cuda.synchronize()  # run() already waited for the loss; this, for the rest.
      return {"seconds": time.perf_counter() - start, "loss": loss}
    if op == "first_loss":
      return {"loss": torch_llama.first_loss(config, params, batch)}
    if op == "parts":
      parts[variant] = torch_llama.components(trainers[variant], config, shape)
      for thunk in parts[variant].values():
        for _ in range(WARMUP_CALLS):  # Compiles (forward, then backward), settles.
          thunk()
      return {"parts": list(parts[variant])}
    if op == "part":
      return {"seconds": timed(parts[variant][request["part"]])}
    raise ValueError(f"unknown op {op!r}")

  replies.write(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                            "device": device}) + "\n")
  for line in sys.stdin:
    try:
      reply = handle(json.loads(line))
    except Exception:  # pylint: disable=broad-except
      reply = {"error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
  serve(pathlib.Path(sys.argv[1]))
