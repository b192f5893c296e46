"""Qwix quantization at tiny size: the schemes' rules, PTQ of a trained run (loss within
a bound of float, bytes by the expected factor, saved and served), QAT (trains, converts
to PTQ losslessly; its resume after SIGKILL: test_kill_and_resume.py), and the bad-input paths."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util

from jax_ai_stack import cli
from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import config, train
from jax_ai_stack.recipes.finetune import ptq, quant
from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
from jax_ai_stack.recipes.models.decoder import Decoder

from training_helpers import STEPS, tiny_config, train_losses

LOSS_BOUNDS = {"w8": 0.005, "w8a8": 0.01, "w4": 0.02}
"""How far each scheme's eval loss may move from float on the tiny LM (loss about 4.3;
measured 0.0002, 0.0002, 0.0016): weights round to 1/255 (int8) or 1/15 (int4) of their
per-channel range."""
ACCURACY_BOUND = 0.05
"""Accuracy points a scheme may lose on the tiny CNN (2 of the 64 validation digits)."""
QAT_BOUND = 1e-3
"""QAT fakes w8a8 exactly as PTQ computes it, so converting costs (almost) nothing."""
BITS = {"w8": (8, 8), "w8a8": (8, 8), "w4": (4, 8)}
"""(MLP weight bits, other weight bits) of each scheme."""


@pytest.fixture(scope="module")
def float_run(reference, tmp_path_factory):
  """A copy of the session's tiny LM run (quantizing writes into the workdir)."""
  workdir = tmp_path_factory.mktemp("quant") / "float"
  shutil.copytree(reference[0], workdir)
  return workdir


@pytest.fixture(scope="module")
def reports(float_run):
  return {scheme: ptq.quantize_run(float_run, scheme) for scheme in quant.SCHEMES}


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("quant") / "qat"
  result = train.run(tiny_config("quant.qat=w8a8", "train.sample_tokens=0"), workdir)
  return workdir, result


def quantized_layers(model) -> dict[str, int]:
  """{module path: bits of its quantized weight values} of a PTQ model."""
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return {"/".join(map(str, path[:-3])): quant._bits(leaf.dtype)
          for path, leaf in flat.items() if path[-1] == "qvalue"}  # .../kernel/array/qvalue


@pytest.mark.parametrize("scheme", list(quant.SCHEMES))
def test_rules_quantize_the_matmuls_and_leave_embedding_norms_and_weight_only_convs(scheme):
  mlp_bits, other_bits = BITS[scheme]
  llama_config = tiny_config().model
  layers = quantized_layers(nnx.eval_shape(  # Shapes only: the structure is what matters.
      lambda: quant.ptq(Decoder(llama_config, rngs=nnx.Rngs(0)), scheme, llama_config)))
  expected = {f"layers/0/attention/{p}_proj": other_bits for p in "qkvo"}
  expected.update({f"layers/0/mlp/{p}_proj": mlp_bits for p in ("gate", "up", "down")})
  assert layers == expected  # Not the tied embedding (the output head), not the norms.

  cnn_config = CNNConfig()
  layers = quantized_layers(nnx.eval_shape(
      lambda: quant.ptq(CNN(cnn_config, rngs=nnx.Rngs(0)), scheme, cnn_config)))
  expected = {"hidden": mlp_bits, "classifier": other_bits}
  if scheme == "w8a8":  # Qwix's PTQ conv needs int8 activations too.
    expected.update({"convs/0": 8, "convs/1": 8})
  assert layers == expected


def test_unknown_scheme_or_kind_is_a_named_error_listing_the_choices():
  with pytest.raises(quant.SchemeError, match="schemes: w8 .*, w8a8 .*, w4 "):
    quant.rules("int3", "llama")
  with pytest.raises(ConfigError, match="kinds: llama, qwen2, qwen3, mistral, gemma2, gemma3, "
                     "mixtral, qwen3_moe, olmo2, olmo3, smollm3, phi3, qwen2_moe, gpt_oss, "
                     "llama4, deepseek_v3, qwen3_next, cnn"):
    quant.rules("w8", "resnet")
  with pytest.raises(ConfigError, match="quant.*unknown quantization scheme 'int3'"):
    tiny_config("quant.qat=int3")
  assert tiny_config().quant.qat is None and tiny_config("quant.qat=w4").quant.qat == "w4"


@pytest.mark.parametrize("scheme", list(quant.SCHEMES))
def test_ptq_loss_stays_within_the_bound_of_float(reports, scheme):
  report = reports[scheme]
  assert report.step == STEPS and report.trained == "float" and report.saved
  delta = report.quantized_metrics["eval_loss"] - report.metrics["eval_loss"]
  assert delta != 0.0  # Something was quantized ...
  assert abs(delta) < LOSS_BOUNDS[scheme]  # ... and it costs little.
  assert report.quantized_metrics["eval_perplexity"] > 1
  assert (report.path / "params").is_dir() and report.path.parent.name == scheme


@pytest.mark.parametrize("scheme", list(quant.SCHEMES))
def test_parameter_bytes_shrink_by_the_expected_factor(reports, scheme):
  model = tiny_config().model
  d, n, k, h, f = model.d_model, model.num_heads, model.num_kv_heads, 16, model.mlp_dim
  mlp_bits, other_bits = BITS[scheme]
  # (values, contraction size, bits) of q, k, v, o, gate, up, down; a float32 scale per output.
  kernels = [(d * n * h, d, other_bits), (d * k * h, d, other_bits), (d * k * h, d, other_bits),
             (n * h * d, n * h, other_bits), (d * f, d, mlp_bits), (d * f, d, mlp_bits),
             (f * d, f, mlp_bits)]
  report = reports[scheme]
  assert report.param_bytes == 4 * model.num_params()
  expected = report.param_bytes - sum(
      4 * size - size * bits // 8 - 4 * size // contracted for size, contracted, bits in kernels)
  assert report.quantized_param_bytes == expected  # Each kernel: 4x (int8) or 8x (int4) + scales.


def test_saved_parameters_serve_eval_and_generate(float_run, reports, capsys):
  assert cli.main(["eval", "--workdir", str(float_run), "--quantized", "w4"]) == 0
  metrics = json.loads(capsys.readouterr().out)
  assert metrics["step"] == STEPS
  assert metrics["eval_loss"] == pytest.approx(reports["w4"].quantized_metrics["eval_loss"],
                                               rel=1e-6)  # The saved parameters, not float's.
  assert metrics["eval_loss"] != reports["w4"].metrics["eval_loss"]
  assert cli.main(["generate", "--workdir", str(float_run), "--quantized", "w8", "--prompt", "def ",
                   "--max-new-tokens", "6", "--temperature", "0"]) == 0
  assert capsys.readouterr().out.startswith("def ")


def test_cli_quantize_again_prints_the_table_and_rewrites_nothing(float_run, reports, capsys):
  saved = reports["w8"].path
  before = {p: p.stat().st_mtime_ns for p in saved.rglob("*")}
  assert cli.main(["quantize", "--workdir", str(float_run), "--scheme", "w8"]) == 0
  out = capsys.readouterr().out
  assert "eval_loss" in out and "param_bytes" in out and "already saved" in out
  float_row, w8_row = [line.split() for line in out.splitlines() if line.split()[:1] in
                       (["float"], ["w8"])]
  assert float(w8_row[1]) == pytest.approx(reports["w8"].quantized_metrics["eval_loss"], abs=1e-4)
  assert {p: p.stat().st_mtime_ns for p in saved.rglob("*")} == before
  del float_row


@pytest.mark.parametrize("scheme", list(quant.SCHEMES))
def test_cnn_logits_stay_close_to_float(scheme):
  cnn_config = CNNConfig()
  model = CNN(cnn_config, rngs=nnx.Rngs(0))
  model.eval()
  images = jax.random.normal(jax.random.key(1), (16, *cnn_config.image_shape))
  quantized = quant.ptq(model, scheme, cnn_config)
  graphdef, state = nnx.split(quantized)
  logits, expected = jax.jit(lambda s: nnx.merge(graphdef, s)(images))(state), model(images)
  error = float(jax.numpy.abs(logits - expected).max() / jax.numpy.abs(expected).max())
  # Measured: 0.011, 0.020, 0.108 of the largest logit.
  assert 0 < error < {"w8": 0.025, "w8a8": 0.04, "w4": 0.2}[scheme]


@pytest.mark.slow  # Trains a CNN (tens of seconds); the test above checks the numerics.
def test_cnn_accuracy_stays_within_the_bound(tmp_path):
  overrides = ["model.channels=[8, 16]", "model.hidden=32", "train.steps=50", "train.eval_every=50",
               "train.eval_batches=2", "train.progress=false", "data.batch_size=32",
               "optim.warmup_steps=5", "optim.learning_rate=0.01", "optim.schedule=constant"]
  train.run(config.load("digits-cnn", overrides=overrides), tmp_path)
  for scheme in ("w8a8", "w4"):  # Convolutions quantized; int4 (w8 is w8a8's weights).
    report = ptq.quantize_run(tmp_path, scheme)
    assert report.metrics["eval_accuracy"] > 0.5  # It learned something to lose.
    delta = report.quantized_metrics["eval_accuracy"] - report.metrics["eval_accuracy"]
    assert abs(delta) <= ACCURACY_BOUND, scheme


# ---- QAT ---------------------------------------------------------------------------


def test_qat_trains_and_converts_to_its_scheme_at_no_cost(qat_run):
  workdir, result = qat_run
  losses = [loss for _, loss in train_losses(workdir)]
  assert result["step"] == STEPS and sum(losses[-5:]) < sum(losses[:5])
  report = ptq.quantize_run(workdir)  # No scheme: the run's own, w8a8.
  assert report.scheme == "w8a8" and report.trained == "qat w8a8"
  delta = report.quantized_metrics["eval_loss"] - report.metrics["eval_loss"]
  assert abs(delta) < QAT_BOUND


# ---- bad input ---------------------------------------------------------------------


def test_cli_unknown_scheme_exits_2_and_creates_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  for command in (["quantize", "--workdir", str(workdir), "--scheme", "int3"],
                  ["eval", "--workdir", str(workdir), "--quantized", "int3"]):
    assert cli.main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown quantization scheme 'int3'; schemes: w8" in err[0]
  assert not workdir.exists()


def test_cli_quantize_without_checkpoint_exits_2_and_writes_nothing(tmp_path, capsys):
  assert cli.main(["quantize", "--workdir", str(tmp_path), "--scheme", "w8"]) == 2
  assert "no checkpoints" in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == []


def test_cli_float_run_needs_a_scheme_and_a_quantize_before_serving(float_run, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(float_run, workdir, ignore=shutil.ignore_patterns(ptq.QUANTIZED_DIR))
  assert cli.main(["quantize", "--workdir", str(workdir)]) == 2
  assert "name a scheme with --scheme" in capsys.readouterr().err
  assert cli.main(["generate", "--workdir", str(workdir), "--quantized", "w8"]) == 2
  assert "run `jax-ai-stack quantize --workdir" in capsys.readouterr().err
  assert not (workdir / ptq.QUANTIZED_DIR).exists()


def test_param_bytes_counts_int4_packed():
  state = {"a": np.zeros((4, 4), np.float32), "b": jax.numpy.zeros((4, 4), jax.numpy.int4)}
  assert quant.param_bytes(state) == 4 * 16 + 16 // 2
