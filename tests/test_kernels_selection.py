"""Selection: order per backend, fallbacks, errors, overrides, caching.

GPU and TPU are simulated by patching the platform query
(`kernels.request.current_backend`) or passing a `Backend`: capability checks
run, nothing is traced. Fallback on NotImplementedError at trace time is tested
on the real CPU with stand-in implementations. Plans (pins, precedence, no
ambient state) are tested in test_kernels_plan.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels
from jax_ai_stack.kernels import request as request_lib
from jax_ai_stack.kernels import table

H100 = kernels.Backend("gpu", "NVIDIA H100 80GB HBM3", "9.0")
T4 = kernels.Backend("gpu", "Tesla T4", "7.5")
MI300 = kernels.Backend("gpu", "AMD Instinct MI300X", None)
TPU_V5E = kernels.Backend("tpu", "TPU v5 lite")
TPU_V4 = kernels.Backend("tpu", "TPU v4")

Q, K = (2, 256, 8, 64), (2, 256, 2, 64)


@pytest.fixture(autouse=True)
def _fresh_selection(fresh_kernel_selection, monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # It changes cuDNN's determinism.


def req(q_shape=Q, k_shape=K, dtype="float32", **masks):
  return kernels.Request.from_shapes(q_shape, k_shape, dtype, **masks)


def verdict(choice, name):
  return next(v for v in choice.verdicts if v.name == name)


def test_cpu_auto_prefers_xla_blocked_then_tokamax_xla_and_never_interprets_pallas():
  choice = kernels.select(req())  # Causal, T 256: the blocked kernel's measured range.
  assert choice.name == "xla_blocked" and choice.probed and not choice.interpret
  assert choice.order == kernels.PREFERENCE["cpu"]
  assert [n for n, _ in choice.fallbacks] == [
      "xla_blocked", "tokamax_xla", "xla", "tokamax_xla_chunked"]
  for name in ("pallas_gpu", "pallas_tpu_flash", "pallas_tpu_splash"):
    assert "interpret mode" in verdict(choice, name).reason


def test_simulated_h100_order_and_reasons():
  choice = kernels.select(req(dtype="bfloat16"), backend=H100)
  assert choice.order == kernels.PREFERENCE["gpu"]
  assert choice.name == "tokamax_mosaic_gpu" and not choice.probed
  assert [n for n, _ in choice.fallbacks] == [
      "tokamax_mosaic_gpu", "tokamax_triton", "cudnn", "pallas_gpu", "tokamax_xla", "xla",
      "tokamax_xla_chunked",
  ]
  assert verdict(choice, "pallas_tpu_splash").reason == "runs on tpu, not gpu"


@pytest.mark.parametrize("backend,dtype,head_dim,masks,chosen,rejected,reason", [
    (T4, "bfloat16", 64, {}, "tokamax_triton", "tokamax_mosaic_gpu", "compute capability >= 8.0"),
    (H100, "float32", 64, {}, "tokamax_mosaic_gpu", "cudnn", "dtype float32 not supported"),
    (H100, "bfloat16", 12, {}, "tokamax_mosaic_gpu", "cudnn", "head_dim 12 must be a multiple of 8"),
    (T4, "bfloat16", 192, {}, "tokamax_triton", "cudnn", "head_dim 192 > 128"),
    (MI300, "bfloat16", 64, {}, "tokamax_triton", "cudnn", "needs an NVIDIA GPU"),
    (MI300, "bfloat16", 64, {}, "tokamax_triton", "tokamax_mosaic_gpu", "compute capability"),
    (H100, "bfloat16", 64, {"local_window": 8}, "tokamax_mosaic_gpu", "pallas_gpu",
     "local_window not supported"),
    (TPU_V5E, "bfloat16", 128, {}, "tokamax_mosaic_tpu", "tokamax_xla", ""),
    (TPU_V4, "bfloat16", 128, {}, "pallas_tpu_splash", "tokamax_mosaic_tpu", "needs TPU v5"),
    (TPU_V4, "bfloat16", 128, {"local_window": 8}, "pallas_tpu_splash", "pallas_tpu_flash",
     "local_window not supported"),
    (TPU_V4, "float16", 128, {}, "tokamax_xla", "pallas_tpu_splash", "dtype float16 not supported"),
])
def test_simulated_backends_choose_and_explain(backend, dtype, head_dim, masks, chosen, rejected, reason):
  q, k = Q[:3] + (head_dim,), K[:3] + (head_dim,)
  choice = kernels.select(req(q, k, dtype, **masks), backend=backend)
  assert choice.name == chosen
  status = verdict(choice, rejected)
  if reason:
    assert status.status == "rejected" and reason in status.reason
  else:
    assert status.status == "eligible"


def test_tpu_sequences_off_the_128_grid_fall_back_to_xla_kernels():
  choice = kernels.select(req((1, 100, 8, 128), (1, 100, 8, 128), "bfloat16"), backend=TPU_V4)
  assert choice.name == "tokamax_xla"
  for name in ("pallas_tpu_splash", "pallas_tpu_flash"):
    assert "must be multiples of 128" in verdict(choice, name).reason


def test_patched_platform_query_drives_select(monkeypatch):
  monkeypatch.setattr(request_lib, "current_backend", lambda: TPU_V5E)
  choice = kernels.select(req((1, 128, 4, 128), (1, 128, 4, 128), "bfloat16"))
  assert choice.backend == TPU_V5E and choice.name == "tokamax_mosaic_tpu"
  assert not choice.probed  # A simulated platform cannot be traced on.


def test_aggregated_error_names_every_rejection():
  with pytest.raises(kernels.NoImplementationError) as e:
    kernels.select(req(), "cudnn,pallas_tpu_flash", backend=H100)
  message = str(e.value)
  assert "cudnn: dtype float32 not supported" in message
  assert "pallas_tpu_flash: runs on tpu, not gpu" in message
  assert "argument implementation" in message


def test_unknown_names_are_named():
  with pytest.raises(ValueError, match="unknown attention implementation 'flash'; known: auto, xla"):
    kernels.select(req(), "xla,flash")
  with pytest.raises(ValueError, match="names no attention implementation"):
    kernels.parse_implementation(" , ")
  with pytest.raises(ValueError, match="dtype 'bf17'"):
    kernels.select(req(dtype="bf17"))


def test_environment_variable_forces_an_order(monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "xla, tokamax_xla")
  choice = kernels.select(req())
  assert choice.name == "xla" and choice.order == ("xla", "tokamax_xla")
  assert kernels.ENV_VAR in choice.source
  # An explicit argument still wins over the environment.
  assert kernels.select(req(), "tokamax_xla_chunked").name == "tokamax_xla_chunked"


def test_bad_environment_variable_is_named(monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "fastest")
  with pytest.raises(ValueError, match=f"environment {kernels.ENV_VAR}: unknown attention implementation 'fastest'"):
    kernels.attention(jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8)))


def test_auto_inside_a_list_expands_and_named_pallas_is_interpreted():
  choice = kernels.select(req((1, 32, 2, 8), (1, 32, 2, 8)), "pallas_gpu,auto")
  assert choice.name == "pallas_gpu" and choice.interpret
  assert choice.order == ("pallas_gpu",) + kernels.PREFERENCE["cpu"]


def test_pins_apply_to_their_request_only():
  plan = kernels.AttentionPlan((kernels.AUTO,), "test pins", pins=((req(), "xla"),))
  pinned = plan.select(req())
  other = plan.select(req(causal=False))
  assert (pinned.name, pinned.source) == ("xla", "pinned by test pins")
  assert other.name == "tokamax_xla"
  assert kernels.select(req()).name == "xla_blocked"  # Pins live in their plan only.


def test_choices_are_cached_per_request():
  first = kernels.select(req())
  assert kernels.select(req(dtype=jnp.float32)) is first
  assert kernels.select(req(causal=False)) is not first


def test_nondeterminism_is_reported():
  choice = kernels.select(req(dtype="bfloat16"), "cudnn", backend=H100)
  assert not choice.deterministic
  assert "NONDETERMINISTIC" in choice.report() and "xla_gpu_deterministic_ops" in choice.report()


def test_deterministic_xla_flag_makes_cudnn_deterministic(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
  assert kernels.select(req(dtype="bfloat16"), "cudnn", backend=H100).deterministic


def test_deterministic_is_said_of_the_whole_step_on_a_gpu(monkeypatch):
  """A deterministic kernel in a step whose XLA ops are not is no deterministic step."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  choice = kernels.select(req(dtype="bfloat16"), backend=H100)
  assert choice.name != "cudnn" and not choice.deterministic
  assert "scatters and reductions" in choice.report().splitlines()[-1]
  assert not choice.to_dict()["deterministic"]
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
  assert kernels.select(req(dtype="bfloat16"), backend=H100).deterministic
  assert kernels.select(req(), backend=kernels.Backend("cpu")).deterministic


def test_report_lists_every_implementation_and_serializes():
  choice = kernels.select(req())
  text = choice.report()
  for name in kernels.IMPLEMENTATIONS:
    assert name in text
  assert "* xla_blocked" in text and text.endswith("Chosen: xla_blocked (deterministic)")
  data = json.loads(json.dumps(choice.to_dict()))
  assert data["implementation"] == "xla_blocked" and data["request"]["num_kv_heads"] == 2
  assert any("cudnn: not in order (runs on gpu, not cpu)" == r for r in choice.reasons)


def test_report_never_raises_when_nothing_fits():
  choice = kernels.report(req(), "cudnn", backend=H100)
  assert choice.name is None and "Chosen: none fits" in choice.report()


# ---- fallback on NotImplementedError, with stand-in implementations ------


def _stand_in(name, run):
  return dataclasses.replace(kernels.IMPLEMENTATIONS["xla"], name=name, run=run)


@pytest.fixture
def stand_ins(monkeypatch):
  """Registers `refuses` (always NotImplementedError), `flaky` (refuses from its
  second call on) and `counted` (the XLA kernel, counting calls), ahead of xla."""
  calls = {"refuses": 0, "flaky": 0, "counted": 0}
  xla = kernels.IMPLEMENTATIONS["xla"].run

  def refuses(*args, **kwargs):
    calls["refuses"] += 1
    raise NotImplementedError("this shape is not for me")

  def flaky(*args, **kwargs):
    calls["flaky"] += 1
    if calls["flaky"] > 1:
      raise NotImplementedError("changed my mind")
    return xla(*args, **kwargs)

  def counted(*args, **kwargs):
    calls["counted"] += 1
    return xla(*args, **kwargs)

  implementations = dict(kernels.IMPLEMENTATIONS)
  for name, run in (("refuses", refuses), ("flaky", flaky), ("counted", counted)):
    implementations[name] = _stand_in(name, run)
  monkeypatch.setattr(table, "IMPLEMENTATIONS", implementations)
  return calls


def test_trace_time_refusal_falls_back_and_is_reported(stand_ins):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 8)), jnp.float32)
  choice = kernels.select(req(x.shape, x.shape, x.dtype), "refuses,xla")
  assert choice.name == "xla"
  assert verdict(choice, "refuses").reason == "NotImplementedError when traced: this shape is not for me"
  out = kernels.attention(x, x, x, implementation="refuses,xla")
  np.testing.assert_allclose(out, jax.nn.dot_product_attention(x, x, x, is_causal=True), atol=1e-6)


def test_refusal_after_selection_falls_through_to_the_next_eligible(stand_ins):
  x = jnp.ones((1, 8, 2, 8))
  out = kernels.attention(x, x, x, implementation="flaky,xla")  # Probe passes, the call refuses.
  assert stand_ins["flaky"] == 2 and out.shape == x.shape


def test_all_refusing_names_each_refusal(stand_ins):
  x = jnp.ones((1, 8, 2, 8))
  with pytest.raises(kernels.NoImplementationError, match="refuses: NotImplementedError when traced"):
    kernels.attention(x, x, x, implementation="refuses")


def test_selection_is_traced_once_per_request(stand_ins):
  x = jnp.ones((1, 8, 2, 8))
  step = lambda x: kernels.attention(x, x, x, implementation="counted")
  for _ in range(3):
    jax.jit(lambda x: step(x))(x)  # A new function each time: traced again...
  assert stand_ins["counted"] == 1 + 3  # ...but probed only once.
