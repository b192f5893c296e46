"""The autotune file: measured kernel choices and tuned configs, as JSON.

`autotuning.autotune` writes it; `load_plan` reads it into an `AttentionPlan`
whose pins are the measured choices and whose `tokamax_configs` are the tuned
block sizes. Timings are noisy, so a rerun could choose differently: keeping
the result in a file is what makes training and resume run the same kernels
with the same configs.

Layout:
  {"format": FORMAT, "platform": "gpu", "device_kind": "NVIDIA H100 ...",
   "jax_version": ..., "tokamax_version": ...,
   "entries": [{"request": Request.to_dict(), "implementation": name,
                "times_ms": {name: ms}}],
   "tokamax": tokamax AutotuningResult JSON, or null}

Example: a file that pins one request to "xla", read into a plan.
  >>> from jax_ai_stack.kernels.request import Backend, Request
  >>> request = Request.from_shapes((1, 128, 4, 64), (1, 128, 4, 64), "float32")
  >>> path = write(AUTOTUNE_FILENAME, {
  ...     "format": FORMAT, "platform": "cpu", "device_kind": "cpu", "tokamax": None,
  ...     "entries": [{"request": request.to_dict(), "implementation": "xla"}]})
  >>> plan = load_plan(path, backend=Backend("cpu", "cpu"))
  >>> plan.source, plan.select(request, backend=Backend("cpu", "cpu")).name
  ('autotune file attention_autotune.json', 'xla')
  >>> load_plan(path, backend=Backend("gpu", "NVIDIA H100 80GB HBM3"))
  Traceback (most recent call last):
  ...
  jax_ai_stack.kernels.autotune_file.AutotuneError: attention_autotune.json: tuned on cpu
  (cpu), but this is gpu (NVIDIA H100 80GB HBM3); rerun `jax-ai-stack kernels --autotune` here
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import UserError
from jax_ai_stack.kernels import implementations, table
from jax_ai_stack.kernels import request as request_lib
from jax_ai_stack.kernels.plan import AttentionPlan
from jax_ai_stack.kernels.request import Backend, Request

AUTOTUNE_FILENAME = "attention_autotune.json"
FORMAT = "jax-ai-stack/attention-autotune/1"


class AutotuneError(UserError, RuntimeError):
  """Autotuning is unavailable, or an autotune file cannot be used (says why)."""


def write(path: str | os.PathLike, document: dict) -> pathlib.Path:
  """Writes `document` atomically (a file already there is replaced only once complete)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomically(path, json.dumps(document, indent=2) + "\n")
  return path


def _read_document(path: pathlib.Path) -> dict:
  """The parsed file; AutotuneError if missing, not JSON or of another format."""
  try:
    document = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise AutotuneError(
        f"{path}: no such autotune file; create it with `jax-ai-stack kernels --autotune`"
    ) from None
  except json.JSONDecodeError as e:
    raise AutotuneError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
  if not isinstance(document, dict) or document.get("format") != FORMAT:
    found = document.get("format") if isinstance(document, dict) else type(document).__name__
    raise AutotuneError(
        f"{path}: not an attention autotune file (format {found!r}, expected {FORMAT!r})"
    )
  return document


def _pins(path: pathlib.Path, entries: Any) -> tuple[tuple[Request, str], ...]:
  """(request, implementation) per entry; AutotuneError names a malformed one."""
  pins = []
  for i, entry in enumerate(entries or ()):
    try:
      request = Request.from_dict(entry["request"])
      name = entry["implementation"]
    except (KeyError, TypeError, ValueError) as e:
      raise AutotuneError(f"{path}: entries[{i}] is malformed ({e})") from None
    if name not in table.IMPLEMENTATIONS:
      raise AutotuneError(f"{path}: entries[{i}] names unknown implementation {name!r}")
    pins.append((request, name))
  return tuple(pins)


def _tokamax_configs(path: pathlib.Path, document: dict) -> str | None:
  """The tuned tokamax configs as JSON, checked to load with this tokamax."""
  configs = document.get("tokamax")
  if not (isinstance(configs, dict) and configs.get("data")):
    return None
  tokamax = implementations.import_tokamax()
  text = json.dumps(configs)
  try:
    tokamax.AutotuningResult.loads(text)
  except Exception as e:  # noqa: BLE001 - any parse failure means the same thing.
    raise AutotuneError(
        f"{path}: tokamax {tokamax.__version__} cannot read the kernel configs written by"
        f" tokamax {document.get('tokamax_version')}: {type(e).__name__}: {e}"
    ) from None
  return text


def load_plan(path: str | os.PathLike, *, backend: Backend | None = None) -> AttentionPlan:
  """The "auto" order with the file's pinned requests and tuned tokamax configs.

  Args:
    path: a file `autotune` wrote.
    backend: the backend the plan is for; default: the current one. The file
      must have been tuned on the same device kind.

  Raises:
    AutotuneError: the file is missing, not JSON, of another format, or was
      tuned on a different device (rerun `jax-ai-stack kernels --autotune`).
  """
  path = pathlib.Path(path)
  document = _read_document(path)
  backend = backend or request_lib.current_backend()
  tuned_on = (document.get("platform"), document.get("device_kind"))
  if tuned_on != (backend.platform, backend.device_kind):
    raise AutotuneError(
        f"{path}: tuned on {tuned_on[0]} ({tuned_on[1]}), but this is {backend.describe()};"
        " rerun `jax-ai-stack kernels --autotune` here"
    )
  pins = _pins(path, document.get("entries"))
  configs = _tokamax_configs(path, document)
  return AttentionPlan((table.AUTO,), f"autotune file {path}", pins, configs)
