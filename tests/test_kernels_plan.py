"""Attention plans: explicit values, pins, precedence, no ambient state, the module layout.

Selection itself (capabilities, probing, fallbacks) is tested in
test_kernels_selection.py; here the plan decides which names selection gets.
"""

from __future__ import annotations

import ast
import json
import pathlib
import typing

import jax.numpy as jnp
import pytest
from packaging.version import Version

from jax_ai_stack import errors, kernels
from jax_ai_stack.kernels import request as request_lib

KERNELS_DIR = pathlib.Path(kernels.__file__).parent
Q, K = (1, 16, 2, 8), (1, 16, 1, 8)
REQUEST = kernels.Request.from_shapes(Q, K, "float32")
OTHER = kernels.Request.from_shapes(Q, K, "float32", causal=False, local_window=4)


pytestmark = pytest.mark.usefixtures("fresh_kernel_selection")


def write_autotune_file(path, implementation, request=REQUEST, tokamax=None):
  """An autotune file for this backend, written by hand: `tokamax.autotune`
  crashes on some rows (see `autotune_unsupported_reason`)."""
  backend = request_lib.current_backend()
  path.write_text(json.dumps({
      "format": "jax-ai-stack/attention-autotune/1",
      "platform": backend.platform,
      "device_kind": backend.device_kind,
      "entries": [{"request": request.to_dict(), "implementation": implementation,
                   "times_ms": {}}],
      "tokamax": tokamax,
  }))
  return path


def test_plan_round_trips_through_json_with_pins_and_configs():
  plan = kernels.AttentionPlan(
      ("xla", kernels.AUTO), "model.attention_impl",
      pins=((REQUEST, "tokamax_xla_chunked"), (OTHER, "xla")),
      tokamax_configs='{"device_kind": "cpu", "data": []}',
  )
  data = json.loads(json.dumps(plan.to_dict()))
  assert data["pins"][1] == {"request": OTHER.to_dict(), "implementation": "xla"}
  restored = kernels.AttentionPlan.from_dict(data)
  assert restored == plan and hash(restored) == hash(plan)
  assert restored.pins[1][0] == OTHER and restored.order == ("xla", "auto")


def test_plans_normalise_their_order_and_are_hashable():
  a = kernels.AttentionPlan("xla, tokamax_xla", "test")
  b = kernels.AttentionPlan(["xla", "tokamax_xla"], "test")
  assert a == b and a.order == ("xla", "tokamax_xla") and len({a, b}) == 1


@pytest.mark.parametrize("data,message", [
    ({"order": ["auto"]}, "needs 'order' and 'source'"),
    ({"order": ["flash"], "source": "checkpoint"}, "checkpoint: unknown attention implementation 'flash'"),
    ({"order": ["auto"], "source": "s", "pins": [{"implementation": "xla"}]}, r"pins\[0\] is malformed"),
    ({"order": ["auto"], "source": "s", "pins": [{"request": {"batch": 1}, "implementation": "xla"}]},
     r"pins\[0\] is malformed \(attention request lacks fields"),
    ({"order": ["auto"], "source": "s", "pins": [{"request": REQUEST.to_dict(), "implementation": "auto"}]},
     "a pin names one implementation, not 'auto'"),
    ({"order": ["auto"], "source": "s", "tokamax_configs": {"data": []}}, "must be JSON text"),
])
def test_malformed_plans_are_named(data, message):
  with pytest.raises(ValueError, match=message):
    kernels.AttentionPlan.from_dict(data)


def test_request_round_trips_and_rejects_unknown_fields():
  assert kernels.Request.from_dict(json.loads(json.dumps(OTHER.to_dict()))) == OTHER
  with pytest.raises(ValueError, match=r"unknown fields \['heads'\]"):
    kernels.Request.from_dict({**REQUEST.to_dict(), "heads": 2})
  with pytest.raises(ValueError, match="must divide num_heads"):
    kernels.Request.from_dict({**REQUEST.to_dict(), "num_kv_heads": 3})


def test_pin_makes_select_return_the_pinned_kernel():
  plan = kernels.resolve_plan(environ={})
  choice = plan.select(REQUEST)
  assert choice.name == "tokamax_xla" and choice.source.startswith("auto")
  forced = kernels.select(REQUEST, "tokamax_xla_chunked")
  pinned = plan.pin(forced)
  assert pinned.pins == ((REQUEST, "tokamax_xla_chunked"),) and plan.pins == ()
  again = pinned.select(REQUEST)
  assert again.name == "tokamax_xla_chunked" and again.order == ("tokamax_xla_chunked",)
  assert again.source == f"pinned by {plan.source}"
  assert pinned.select(OTHER).name == "tokamax_xla"  # Other requests keep the order.
  repinned = pinned.pin(kernels.select(REQUEST, "xla"))
  assert repinned.pins == ((REQUEST, "xla"),)  # One pin per request: the newest.


def test_pinning_nothing_is_refused():
  choice = kernels.report(REQUEST, "cudnn")
  with pytest.raises(ValueError, match="cannot pin a choice that names no implementation"):
    kernels.resolve_plan(environ={}).pin(choice)


def test_resolve_precedence_argument_environment_file_auto(tmp_path):
  path = write_autotune_file(tmp_path / "tuned.json", "tokamax_xla_chunked")
  env = {kernels.ENV_VAR: "xla"}
  by_argument = kernels.resolve_plan("tokamax_xla", origin="model.attention_impl", environ=env,
                                     autotune_file=path)
  assert (by_argument.order, by_argument.source) == (("tokamax_xla",), "model.attention_impl")
  assert by_argument.pins == () and by_argument.tokamax_configs is None
  by_environment = kernels.resolve_plan("auto", environ=env, autotune_file=path)
  assert by_environment.order == ("xla",) and kernels.ENV_VAR in by_environment.source
  assert by_environment.select(REQUEST).name == "xla"  # The environment beats the file.
  by_file = kernels.resolve_plan("auto", environ={}, autotune_file=path)
  assert by_file.order == ("auto",) and by_file.source == f"autotune file {path}"
  assert by_file.pins == ((REQUEST, "tokamax_xla_chunked"),)
  assert by_file.select(REQUEST).name == "tokamax_xla_chunked"
  assert by_file.select(OTHER).name == "tokamax_xla"
  by_default = kernels.resolve_plan("auto", environ={})
  assert by_default.order == ("auto",) and by_default.source.startswith("auto")


def test_resolve_reads_os_environ_only_when_environ_is_none(monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "xla")
  assert kernels.resolve_plan().order == ("xla",)
  assert kernels.resolve_plan(environ={}).order == ("auto",)


def test_environment_changes_after_resolving_do_not_change_a_plan(monkeypatch):
  plan = kernels.resolve_plan()
  before = plan.select(REQUEST)
  monkeypatch.setenv(kernels.ENV_VAR, "xla")
  kernels.clear_cache()
  assert plan.select(REQUEST).name == before.name == "tokamax_xla"
  x = jnp.ones(Q)
  kv = x[:, :, :1]
  out = kernels.attention(x, kv, kv, plan=plan)
  assert out.shape == Q
  assert kernels.resolve_plan().select(REQUEST).name == "xla"  # A new plan sees it.


def test_bad_names_name_their_origin_and_are_usage_errors():
  with pytest.raises(kernels.UnknownImplementationError,
                     match="model.attention_impl: unknown attention implementation 'flash'; known: auto"):
    kernels.resolve_plan("flash", origin="model.attention_impl")
  with pytest.raises(ValueError, match=f"environment {kernels.ENV_VAR}: unknown .* 'fastest'"):
    kernels.resolve_plan(environ={kernels.ENV_VAR: "fastest"})
  assert issubclass(kernels.UnknownImplementationError, errors.UsageError)


def test_a_kernel_that_cannot_run_here_is_a_usage_error():
  assert issubclass(kernels.NoImplementationError, NotImplementedError)
  assert issubclass(kernels.NoImplementationError, errors.UsageError)
  assert issubclass(kernels.AutotuneError, errors.UserError)
  assert issubclass(kernels.AutotuneError, RuntimeError)
  with pytest.raises(errors.UsageError, match="cudnn: runs on gpu, not cpu"):
    kernels.resolve_plan("cudnn", origin="model.attention_impl").select(REQUEST)


def test_selection_is_cached_per_plan_and_request():
  plan = kernels.resolve_plan(environ={})
  first = plan.select(REQUEST)
  assert kernels.resolve_plan(environ={}).select(REQUEST) is first  # An equal plan.
  assert plan.pin(first).select(REQUEST) is not first  # Another plan.


def test_attention_takes_a_plan_or_an_implementation_not_both():
  x = jnp.ones(Q)
  with pytest.raises(ValueError, match="a plan or an implementation, not both"):
    kernels.attention(x, x, x, plan=kernels.resolve_plan(environ={}), implementation="xla")


def test_kernel_configs_enter_tokamax_results_or_nothing():
  assert kernels.AttentionPlan(("auto",), "s").kernel_configs().__enter__() is None
  plan = kernels.AttentionPlan(("auto",), "s", tokamax_configs='{"device_kind": "cpu", "data": []}')
  with plan.kernel_configs() as configs:
    assert type(configs).__name__ == "AutotuningResult" and configs.device_kind == "cpu"
  with plan.kernel_configs():  # A fresh context each time: enterable again.
    pass


def test_implementation_name_literal_lists_the_table():
  assert typing.get_args(kernels.ImplementationName) == tuple(kernels.IMPLEMENTATIONS)


def test_kernel_modules_are_small_and_use_no_ambient_state():
  for path in sorted(KERNELS_DIR.glob("*.py")):
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 300, f"{path.name} has more than 300 lines"
    imported = set()
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, ast.Import):
        imported |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom):
        imported.add(node.module or "")
    assert "contextvars" not in imported, f"{path.name} imports contextvars"
  assert not (KERNELS_DIR / "registry.py").exists()


def test_a_plan_made_for_a_backend_selects_for_it_and_is_not_saved_with_it():
  """A run compiled for a TPU slice from this CPU selects TPU kernels in every call its
  model makes, without naming the backend each time; the saved plan names no backend."""
  tpu = kernels.Backend("tpu", "TPU v5 lite")
  request = kernels.Request.from_shapes((1, 128, 2, 128), (1, 128, 1, 128), "bfloat16")
  plan, choice = kernels.plan_for_run(request, "pallas_tpu_flash,xla", environ={}, backend=tpu,
                                      probe=False)
  assert plan.backend == tpu and choice.backend == tpu
  assert choice.name == "pallas_tpu_flash"
  other = kernels.Request.from_shapes((2, 128, 2, 128), (2, 128, 1, 128), "bfloat16")
  assert plan.select(other).backend == tpu  # Not pinned: selected for the plan's backend.
  assert "backend" not in plan.to_dict()
  assert kernels.AttentionPlan.from_dict(plan.to_dict()).backend is None
  here, _ = kernels.plan_for_run(request, "pallas_tpu_flash,xla", environ={})
  assert here.backend is None and here != plan  # Jit keys on the plan: they differ.


def test_compiling_for_another_platform_turns_tokamax_s_device_check_off():
  import jax

  from jax_ai_stack.kernels import implementations

  tokamax = implementations.import_tokamax()
  with kernels.compiling_for(jax.default_backend()):
    assert not tokamax.config.cross_compile.value
  with kernels.compiling_for("tpu"):
    assert tokamax.config.cross_compile.value
  assert not tokamax.config.cross_compile.value


def test_a_target_s_kernels_are_probed_for_its_platform():
  """Probing traces a candidate abstractly: for a TPU from this CPU, tokamax's Mosaic
  kernel is traced as for the chip (its device check off: `compiling_for`), and chosen as
  it would be there."""
  from jax_ai_stack.kernels import implementations

  tpu = kernels.Backend("tpu", "TPU v5 lite")
  request = kernels.Request.from_shapes((1, 128, 2, 128), (1, 128, 1, 128), "bfloat16")
  _, probed = kernels.plan_for_run(request, "tokamax_mosaic_tpu,xla", environ={}, backend=tpu,
                                   probe=True)
  if Version(implementations.import_tokamax().__version__) >= Version("0.0.17"):
    assert probed.name == "tokamax_mosaic_tpu"
    assert "Not supported on" not in probed.report()
  else:  # tokamax 0.0.12 checks the host's device whatever its cross_compile option says.
    assert probed.name == "xla"
    assert "tokamax_mosaic_tpu   no        NotImplementedError when traced: Not supported on cpu" \
        in probed.report()
