"""Autotune writes a pinned choice; a plan read from it fixes the kernels; bad files are named."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels import autotuning, rules
from jax_ai_stack.kernels import request as request_lib

Q, K = (1, 16, 2, 8), (1, 16, 1, 8)
REQUEST = kernels.Request.from_shapes(Q, K, "float32")
CAN_AUTOTUNE = autotuning.autotune_unsupported_reason() is None


pytestmark = pytest.mark.usefixtures("fresh_kernel_selection")


def write_pins(path, implementation, **overrides):
  """An autotune file as `autotune` writes it, for this backend, by hand."""
  backend = request_lib.current_backend()
  document = {
      "format": autotuning.FORMAT,
      "platform": backend.platform,
      "device_kind": backend.device_kind,
      "entries": [{
          "request": REQUEST.to_dict(),
          "implementation": implementation,
          "times_ms": {},
      }],
      "tokamax": None,
  }
  document.update(overrides)
  path.write_text(json.dumps(document))
  return path


def test_unsupported_reason_matches_the_installed_tokamax():
  reason = autotuning.autotune_unsupported_reason()
  if rules.tokamax_version() == (0, 0, 12):
    assert "tokamax 0.0.12 crashes in tokamax.autotune" in reason
  else:
    assert reason is None


def test_autotune_refuses_clearly_where_tokamax_crashes(monkeypatch, tmp_path):
  monkeypatch.setattr(rules, "tokamax_version", lambda: (0, 0, 12))
  with pytest.raises(kernels.AutotuneError, match="0.0.12 crashes in tokamax.autotune.*0.0.17 works"):
    kernels.autotune([REQUEST], tmp_path / "tuned.json")
  assert not (tmp_path / "tuned.json").exists()


@pytest.mark.skipif(not CAN_AUTOTUNE, reason=f"{autotuning.autotune_unsupported_reason()}")
def test_autotune_writes_a_choice_that_loading_pins(tmp_path):
  path = kernels.autotune([REQUEST], tmp_path / "run" / kernels.AUTOTUNE_FILENAME,
                          iterations=1, rounds=1)
  document = json.loads(path.read_text())
  assert document["format"] == autotuning.FORMAT and document["platform"] == "cpu"
  (entry,) = document["entries"]
  assert set(entry["times_ms"]) == {"tokamax_xla", "xla", "tokamax_xla_chunked"}
  assert all(ms > 0 for ms in entry["times_ms"].values())
  fastest = min(entry["times_ms"].values())
  assert entry["times_ms"][entry["implementation"]] <= fastest * 1.05
  assert document["tokamax"]["device_kind"] == "cpu"  # tokamax's own result, reloadable.

  x = jnp.asarray(np.random.default_rng(0).normal(size=Q), jnp.float32)
  kv = x[:, :, :1]
  plan = kernels.resolve_plan(environ={}, autotune_file=path)
  assert plan.tokamax_configs is not None
  with plan.kernel_configs():
    choice = plan.select(REQUEST)
    pinned_out = kernels.attention(x, kv, kv, plan=plan)
  assert choice.name == entry["implementation"] and str(path) in choice.source
  direct = kernels.attention(x, kv, kv, implementation=entry["implementation"])
  np.testing.assert_array_equal(pinned_out, direct)


@pytest.mark.filterwarnings("ignore:jax.core.is_concrete is deprecated:DeprecationWarning")
def test_autotune_times_and_pins_even_without_tokamax_tuning(monkeypatch, tmp_path):
  """The timing and file half of `autotune`, on any tokamax: its `autotune`
  (which crashes on 0.0.12) is replaced by "nothing tuned"."""
  monkeypatch.setattr(autotuning, "autotune_unsupported_reason", lambda: None)
  monkeypatch.setattr(autotuning, "_tune_tokamax", lambda *args: None)
  path = kernels.autotune([REQUEST], tmp_path / "run" / kernels.AUTOTUNE_FILENAME,
                          iterations=1, rounds=1)
  document = json.loads(path.read_text())
  (entry,) = document["entries"]
  assert entry["request"] == REQUEST.to_dict() and document["tokamax"] is None
  assert set(entry["times_ms"]) == {"tokamax_xla", "xla", "tokamax_xla_chunked"}
  assert entry["times_ms"][entry["implementation"]] <= min(entry["times_ms"].values()) * 1.05
  plan = kernels.resolve_plan(environ={}, autotune_file=path)
  choice = plan.select(REQUEST)
  assert choice.name == entry["implementation"] and choice.source == f"pinned by autotune file {path}"


def test_loaded_file_decides_even_against_the_preference(tmp_path):
  path = write_pins(tmp_path / "tuned.json", "tokamax_xla_chunked")
  assert kernels.select(REQUEST).name == "tokamax_xla"
  plan = kernels.resolve_plan(environ={}, autotune_file=path)
  choice = plan.select(REQUEST)
  unpinned = plan.select(dataclasses.replace(REQUEST, causal=False))
  assert choice.name == "tokamax_xla_chunked" and choice.source == f"pinned by autotune file {path}"
  assert unpinned.name == "tokamax_xla"
  assert kernels.select(REQUEST).name == "tokamax_xla"
  assert plan.tokamax_configs is None
  with plan.kernel_configs():  # Nothing tuned: a no-op context.
    pass


@pytest.mark.parametrize("content,message", [
    (None, "no such autotune file; create it with `jax-ai-stack kernels --autotune`"),
    ("{\n  \"format\": ", r"tuned.json:2:13: not valid JSON"),
    (json.dumps({"format": "other/1"}), "not an attention autotune file \\(format 'other/1'"),
    (json.dumps([1, 2]), "not an attention autotune file \\(format 'list'"),
])
def test_unreadable_files_are_named(tmp_path, content, message):
  path = tmp_path / "tuned.json"
  if content is not None:
    path.write_text(content)
  with pytest.raises(kernels.AutotuneError, match=message):
    kernels.load_plan(path)


def test_files_from_another_device_or_with_bad_entries_are_named(tmp_path):
  path = write_pins(tmp_path / "tuned.json", "xla", platform="gpu", device_kind="NVIDIA H100")
  with pytest.raises(kernels.AutotuneError, match="tuned on gpu \\(NVIDIA H100\\), but this is cpu"):
    kernels.load_plan(path)
  write_pins(path, "fastest")
  with pytest.raises(kernels.AutotuneError, match="entries\\[0\\] names unknown implementation 'fastest'"):
    kernels.load_plan(path)
  write_pins(path, "xla", entries=[{"implementation": "xla"}])
  with pytest.raises(kernels.AutotuneError, match="entries\\[0\\] is malformed"):
    kernels.load_plan(path)
  write_pins(path, "xla", tokamax={"device_kind": "cpu", "data": [["not", "configs"]]},
             tokamax_version="9.9.9")
  with pytest.raises(kernels.AutotuneError, match="cannot read the kernel configs written by tokamax 9.9.9"):
    kernels.load_plan(path)
