"""`jax-ai-stack kernels`: a truthful table, JSON, usage errors, autotune wiring."""

from __future__ import annotations

import json
import re

import pytest

from jax_ai_stack import cli, kernels
from jax_ai_stack.kernels import autotuning


@pytest.fixture(autouse=True)
def _kernels_command(monkeypatch):
  """Registers the command whether or not cli._COMMAND_MODULES lists it yet."""
  if "jax_ai_stack.kernels.cli" not in cli._COMMAND_MODULES:
    monkeypatch.setattr(cli, "_COMMAND_MODULES", cli._COMMAND_MODULES + ("jax_ai_stack.kernels.cli",))
  monkeypatch.delenv(kernels.ENV_VAR, raising=False)
  kernels.clear_cache()


def run(capsys, *args):
  code = cli.main(["kernels", *args])
  out, err = capsys.readouterr()
  return code, out, err


def test_table_names_every_implementation_and_the_true_choice(capsys):
  code, out, _ = run(capsys, "--shape", "2,64,4,2,16", "--segment-ids")
  assert code == 0
  for name in kernels.IMPLEMENTATIONS:
    assert f" {name} " in out
  truth = kernels.select(
      kernels.Request.from_shapes((2, 64, 4, 16), (2, 64, 2, 16), "float32", segment_ids=True))
  assert f"* {truth.name} " in out and f"Chosen: {truth.name} (deterministic)\n" in out
  grouped, paged = kernels.choose_grouped_matmul("auto"), kernels.choose_paged_attention("auto")
  assert f"grouped matmul (MoE experts): {grouped[0]} ({grouped[1]}); a recipe sets " \
         "model.moe.grouped_matmul\n" in out
  assert out.rstrip().endswith(f"paged attention (the generation engine's decoding): "
                               f"{paged[0]} ({paged[1]})")
  assert "q [2,64,4,16] k/v [2,64,2,16] float32, causal, segment_ids" in out
  assert "runs on gpu, not cpu" in out


def test_environment_override_shows_in_the_table(capsys, monkeypatch):
  monkeypatch.setenv(kernels.ENV_VAR, "xla")
  code, out, _ = run(capsys, "--shape", "1,32,2,2,8")
  assert code == 0 and f"Order tried (environment {kernels.ENV_VAR}): xla" in out
  assert "Chosen: xla" in out


def test_json_output(capsys):
  code, out, _ = run(capsys, "--shape", "1,32,2,1,8", "--kv-len", "48", "--no-causal",
                     "--kv-seq-lengths", "--json")
  data = json.loads(out)
  assert code == 0 and data["implementation"] == "tokamax_xla"
  assert data["request"]["kv_len"] == 48 and data["request"]["causal"] is False
  assert {v["name"] for v in data["verdicts"]} == set(kernels.IMPLEMENTATIONS)


def test_simulated_tpu(capsys):
  code, out, _ = run(capsys, "--platform", "tpu", "--device-kind", "TPU v4",
                     "--shape", "1,256,8,8,128", "--local-window", "64")
  assert code == 0
  assert "capability checks only" in out and "Chosen: pallas_tpu_splash" in out
  assert "needs TPU v5 or newer" in out and "bfloat16" in out  # bf16 default off CPU.


def test_nothing_fits_exits_1(capsys):
  code, out, err = run(capsys, "--implementation", "cudnn", "--shape", "1,32,2,2,8")
  assert code == 1 and "Chosen: none fits" in out
  assert "no attention implementation fits" in err


@pytest.mark.parametrize("args,message", [
    (["--shape", "1,2,3"], "--shape '1,2,3' must be five positive ints B,T,N,K,H"),
    (["--shape", "1,0,2,2,8"], "must be five positive ints"),
    (["--kv-len", "0"], "--kv-len 0 must be a positive int"),
    (["--dtype", "int8"], "dtype int8 is not a floating dtype"),
    (["--implementation", "flash"], "unknown attention implementation 'flash'"),
    (["--shape", "1,32,4,3,8"], "num_kv_heads 3 .* must divide num_heads 4"),
    (["--device-kind", "TPU v4"], "--device-kind and --compute-capability need --platform"),
    (["--autotune", "--platform", "gpu"], "--autotune measures the real backend"),
    (["--autotune", "--implementation", "xla"], "--autotune chooses among the 'auto' candidates"),
])
def test_usage_errors_exit_2_with_one_line(capsys, args, message):
  code, _, err = run(capsys, *args)
  assert code == 2
  assert err.count("\n") == 1 and err.startswith("jax-ai-stack kernels: error: ")
  assert re.search(message, err), err


def test_autotune_unavailable_says_why(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(autotuning, "autotune_unsupported_reason", lambda: "tokamax 0.0.12 crashes")
  code, _, err = run(capsys, "--autotune", "--workdir", str(tmp_path), "--shape", "1,16,2,1,8")
  assert code == 1 and "--autotune is not available: tokamax 0.0.12 crashes" in err
  assert not list(tmp_path.iterdir())


def test_autotune_writes_to_the_workdir(capsys, monkeypatch, tmp_path):
  calls = []

  def fake_autotune(requests, path, **kwargs):  # The real one is tested in test_kernels_autotuning.
    calls.append((list(requests), path, kwargs))
    path.write_text(json.dumps({"entries": [
        {"implementation": "xla", "times_ms": {"tokamax_xla": 2.0, "xla": 1.0}}]}))
    return path

  monkeypatch.setattr(autotuning, "autotune_unsupported_reason", lambda: None)
  monkeypatch.setattr(autotuning, "autotune", fake_autotune)
  code, out, _ = run(capsys, "--autotune", "--workdir", str(tmp_path), "--shape", "1,16,2,1,8",
                     "--segment-ids")
  assert code == 0
  ((requests, path, kwargs),) = calls
  assert requests == [kernels.Request.from_shapes(
      (1, 16, 2, 8), (1, 16, 1, 8), "float32", causal=True, segment_ids=True, local_window=None,
      kv_seq_lengths=False)]
  assert path == tmp_path / kernels.AUTOTUNE_FILENAME
  assert kwargs == {}
  assert "Autotuned: xla (forward+backward: tokamax_xla 2.00 ms, xla 1.00 ms)" in out
  assert f"Saved {path}" in out


def test_with_no_shape_it_shows_the_default_recipe_s_attention(capsys):
  """The table a user sees first is about the kernel `jax-ai-stack train` picks."""
  from jax_ai_stack.recipes import config, tasks

  request = tasks.for_config(config.load(config.DEFAULT_PRESET)).attention_request()
  code, out, _ = run(capsys, "--segment-ids")  # The run packs documents: segment ids.
  assert code == 0
  r = request
  assert (f"q [{r.batch},{r.q_len},{r.num_heads},{r.head_dim}] "
          f"k/v [{r.batch},{r.kv_len},{r.num_kv_heads},{r.head_dim}] float32, causal, "
          "segment_ids") in out
  assert f"Chosen: {kernels.select(request).name} (deterministic)\n" in out
