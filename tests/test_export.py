"""`export-hf` writes what a run computes: a LoRA run's adapters merged, a DPO run's policy
(not its reference), a QLoRA run's adapters over the float base it was quantized from, a
QAT run's float weights; each said in one line where the export differs from the run, and a
Qwix-quantized result refused by name. `lora merge` works on a DPO-LoRA run too."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import cli
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.finetune import adapters, ptq
from jax_ai_stack.recipes.models import hf

from training_helpers import tiny_config

TOLERANCE = 1e-5
"""float32: the merged W + (alpha/r) A B against W x + (alpha/r) (x A) B, rounding only."""

TOKENS = jnp.arange(16, dtype=jnp.int32)[None] % 256
SHORT = ["train.steps=2", "train.eval_every=0", "train.sample_tokens=0"]


def lora_overrides(base, *extra):
  return [f"finetune.base={base}", "finetune.lora.rank=4", "optim.learning_rate=1e-2",
          "data.paths=[json/*]", *SHORT, *extra]


def run_logits(workdir) -> np.ndarray:
  """The run's own model on TOKENS, as it trains (Qwix's adapters or fake quantization)."""
  run = train.Trainer.open_finished(workdir)
  try:
    return np.asarray(nnx.jit(lambda m, t: m(t))(run.model, TOKENS))
  finally:
    run.close()


def export(capsys, workdir, out) -> str:
  code = cli.main(["export-hf", "--workdir", str(workdir), str(out)])
  err = capsys.readouterr().err
  assert code == 0, err
  return err


def exported_logits(out) -> np.ndarray:
  return np.asarray(hf.load_model(out)(TOKENS))


@pytest.fixture(scope="module")
def base(reference):
  return reference[0]  # The tiny LM run the trainer tests share.


@pytest.mark.slow
def test_a_lora_run_exports_its_adapters_merged(base, tmp_path, capsys):
  train.run(tiny_config(*lora_overrides(base)), tmp_path / "lora")
  err = export(capsys, tmp_path / "lora", tmp_path / "out")
  assert "note: merged the LoRA adapters (rank 4, alpha 8) into the base" in err
  ours, theirs = run_logits(tmp_path / "lora"), exported_logits(tmp_path / "out")
  np.testing.assert_allclose(theirs, ours, atol=TOLERANCE, rtol=TOLERANCE)
  assert np.abs(theirs - run_logits(base)).max() > 100 * TOLERANCE  # The adapters did move it.


@pytest.mark.slow
def test_a_qlora_run_merges_into_the_float_base_it_was_quantized_from(base, tmp_path, capsys):
  train.run(tiny_config(*lora_overrides(base, "finetune.lora.quantize_base=w8")), tmp_path / "q")
  err = export(capsys, tmp_path / "q", tmp_path / "out")
  assert (f"note: QLoRA run: merged the LoRA adapters (rank 4, alpha 8) into the float weights "
          f"of its base ({base / 'checkpoints'} step 30), not into their w8 quantization") in err
  run = train.Trainer.open_finished(tmp_path / "q")
  try:
    a, b = (np.asarray(x) for x in adapters.adapter_pairs(run.model)["layers/0/mlp/up_proj/kernel"])
  finally:
    run.close()
  floats = train.Trainer.open_finished(base)
  try:
    up = np.asarray(floats.model.layers[0].mlp.up_proj.kernel.get_value())
    embedding = np.asarray(floats.model.embed.embedding.get_value())
  finally:
    floats.close()
  exported = hf.load_model(tmp_path / "out")
  np.testing.assert_allclose(np.asarray(exported.layers[0].mlp.up_proj.kernel.get_value()),
                             up + 2.0 * a @ b, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(exported.embed.embedding.get_value()), embedding)


@pytest.mark.slow
def test_a_qat_run_exports_its_float_weights_and_says_so(base, tmp_path, capsys):
  train.run(tiny_config("quant.qat=w8", *SHORT), tmp_path / "qat")
  err = export(capsys, tmp_path / "qat", tmp_path / "out")
  assert "note: QAT run: exported its float weights; the w8 fake quantization" in err
  run = train.Trainer.open_finished(tmp_path / "qat")
  try:
    trained = {path: np.asarray(v.get_value())
               for path, v in nnx.to_flat_state(nnx.state(run.model, nnx.Param))}
  finally:
    run.close()
  exported = dict(nnx.to_flat_state(nnx.state(hf.load_model(tmp_path / "out"), nnx.Param)))
  assert trained.keys() == exported.keys()
  assert all(np.array_equal(trained[p], np.asarray(exported[p].get_value())) for p in trained)


def test_a_quantized_result_is_refused_naming_the_run_to_export(base, tmp_path, capsys):
  quantized = ptq.quantized_dir(base, "w8")
  quantized.mkdir(parents=True, exist_ok=True)
  try:
    assert cli.main(["export-hf", "--workdir", str(quantized), str(tmp_path / "out")]) == 2
  finally:
    quantized.rmdir()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "holds Qwix-quantized weights" in err[0]
  assert f"export the float run instead: jax-ai-stack export-hf --workdir {base} OUT" in err[0]
  assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  path = tmp_path_factory.mktemp("pairs") / "p.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}", "chosen": "yes", "rejected": "no"})
                          + "\n" for i in range(60)))
  return path


@pytest.mark.slow
@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_a_dpo_run_exports_its_policy_and_lora_merge_keeps_its_reference(
    base, pairs, tmp_path, capsys, tuning):
  overrides = [f"finetune.base={base}", "data.source=preference", f"data.paths=[{pairs}]",
               "data.seq_len=32", "data.validation_fraction=0.3", "optim.learning_rate=1e-2",
               "train.steps=2", "train.eval_every=2", "train.sample_tokens=0",
               "finetune.lora={rank: 4}" if tuning == "lora" else "finetune.lora=null"]
  train.run(tiny_config(*overrides), tmp_path / "dpo")
  export(capsys, tmp_path / "dpo", tmp_path / "out")
  ours = run_logits(tmp_path / "dpo")
  np.testing.assert_allclose(exported_logits(tmp_path / "out"), ours, atol=TOLERANCE,
                             rtol=TOLERANCE)
  if tuning == "full":
    return
  code = cli.main(["lora", "merge", "--workdir", str(tmp_path / "dpo"), "--out",
                   str(tmp_path / "merged")])
  _, err = capsys.readouterr()
  assert code == 0, err
  merged = train.Trainer.open_finished(tmp_path / "merged")
  try:  # A full-weight DPO run over the same base: its reference, a frozen copy of it.
    assert merged.config.finetune.lora is None and merged.config.finetune.base == str(base)
    assert merged.transforms.reference_model(merged.model) is not None
  finally:
    merged.close()
  np.testing.assert_allclose(run_logits(tmp_path / "merged"), ours, atol=TOLERANCE,
                             rtol=TOLERANCE)
  code = cli.main(["eval", "--workdir", str(tmp_path / "merged")])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert "eval_preference_accuracy" in json.loads(out)


@pytest.mark.slow
def test_a_lora_run_is_a_base_its_adapters_merged_as_it_loads(base, pairs, tmp_path, capsys):
  """SFT with LoRA, then DPO with LoRA on top of it: the second stage starts at the first's
  model (its adapters merged into its base), says so, and resumes reading it the same way."""
  train.run(tiny_config(*lora_overrides(base)), tmp_path / "sft")
  overrides = [f"finetune.base={tmp_path / 'sft'}", "data.source=preference",
               f"data.paths=[{pairs}]", "data.seq_len=32", "data.validation_fraction=0.3",
               "finetune.lora={rank: 2}", "train.eval_every=0", "train.sample_tokens=0",
               "train.steps=2", "optim.learning_rate=1e-12"]  # B stays ~0 after a step.
  train.run(tiny_config(*overrides), tmp_path / "dpo", stop_after=1)
  err = capsys.readouterr().err
  assert (f"note: finetune.base={str(tmp_path / 'sft')!r} is a LoRA run: its adapters (rank 4, "
          f"alpha 8) are merged into its base ({base / 'checkpoints'} step 30) as it loads") in err
  np.testing.assert_allclose(run_logits(tmp_path / "dpo"), run_logits(tmp_path / "sft"),
                             atol=TOLERANCE, rtol=TOLERANCE)
  train.run(tiny_config(*overrides), tmp_path / "dpo")  # Resumed: the base is read again.
  steps = [r["step"] for r in train.read_metrics(tmp_path / "dpo") if r["split"] == "train"]
  assert steps == [1, 2]
