"""(Q)LoRA fine-tuning end to end at tiny size: only adapters train and are saved, the
merged weights compute what base + adapters compute (resume after SIGKILL:
test_kill_and_resume.py), and bad input (a base that does not fit, a rank too large, a base missing, gone or changed)
is a named error with exit 2 that writes nothing."""

from __future__ import annotations

import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import cli
from jax_ai_stack.errors import CheckpointMismatchError
from jax_ai_stack.recipes import config, train
from jax_ai_stack.recipes.finetune import lora_merge
from jax_ai_stack.recipes.metrics import MetricsLog, eval_change

from multidevice import run_on_devices
from training_helpers import STEPS, TINY, checkpoint_paths, tiny_config, train_losses

MERGE_TOLERANCE = 1e-5
"""Logits of W + (alpha/r) A B against W x + (alpha/r) (x A) B: float32 rounding only."""


def lora_overrides(base, *extra):
  """A LoRA run over `base` on other text than the base read (the stdlib's json package)."""
  return [f"finetune.base={base}", "finetune.lora.rank=4", "optim.learning_rate=1e-2",
          "optim.weight_decay=0", "data.paths=[json/*]", *extra]


@pytest.fixture(scope="module")
def base(reference):
  return reference[0]  # The tiny LM run the trainer tests share (30 steps).


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lora")
  result = train.run(tiny_config(*lora_overrides(base)), workdir)
  return workdir, result


def opened(workdir):
  trainer = train.Trainer.open_finished(workdir)
  trainer.close()
  return trainer


def flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(map(str, path)): np.asarray(v.get_value())
          for path, v in nnx.to_flat_state(tree)}


def logits(model, tokens):
  return nnx.jit(lambda m, t: m(t))(model, tokens)  # Eagerly, Qwix's interception is slow.


def steps_on_disk(workdir) -> list[str]:
  directory = workdir / train.CHECKPOINT_DIR
  return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


@pytest.mark.slow
def test_lora_trains_and_saves_only_the_adapters(base, lora_run):
  workdir, result = lora_run
  assert result["step"] == STEPS
  base_params = flat(nnx.state(opened(base).model, nnx.Param))
  tuned = opened(workdir)
  params = flat(nnx.state(tuned.model, nnx.Param))
  adapters = flat(nnx.state(tuned.model, nnx.LoRAParam))
  assert adapters and all(name.endswith(("_lora_a", "_lora_b")) for name in adapters)
  for name, value in base_params.items():  # The base: bitwise the base run's weights.
    assert np.array_equal(params[name], value), name
  assert any(np.abs(v).max() > 0 for n, v in adapters.items() if n.endswith("_lora_b"))  # B trained.
  moments = [name for name in flat(nnx.state(tuned.optimizer)) if "/mu/" in name or "/nu/" in name]
  assert moments and all(name.endswith(("_lora_a", "_lora_b")) for name in moments)
  assert len(moments) == 2 * len(adapters)  # Adam's mu and nu, of the adapters alone.
  saved_model = [p for p in checkpoint_paths(workdir) if p.startswith("0/")]
  assert saved_model and all(p.endswith(("_lora_a", "_lora_b")) for p in saved_model)
  pointer = tuned.transforms.metadata()["finetune"]
  assert pointer["base"] == str((base / train.CHECKPOINT_DIR).absolute())
  assert pointer["step"] == STEPS


def test_held_out_and_train_loss_drop(lora_run, capsys):
  workdir, _ = lora_run
  evals = [r for r in train.read_metrics(workdir) if r["split"] == "eval"]
  assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
  losses = [loss for _, loss in train_losses(workdir)]
  assert np.mean(losses[-5:]) < np.mean(losses[:5])
  lines = eval_change(workdir, 3e-3)
  assert len(lines) == 1 and "held-out eval_loss" in lines[0]  # It fell: no hint.


def test_a_held_out_loss_that_rose_gets_a_learning_rate_hint(tmp_path):
  log = MetricsLog(tmp_path, 0)
  for step, loss in ((0, 1.880), (50, 1.902), (100, 1.965)):
    log.write(step, "eval", {"eval_loss": loss})
  log.close()
  change, hint = eval_change(tmp_path, 3e-3)
  assert change == "held-out eval_loss 1.8800 before fine-tuning -> 1.9650 at step 100"
  assert hint.startswith("hint: held-out loss rose") and "optim.learning_rate=0.0003" in hint
  assert eval_change(tmp_path / "elsewhere", 3e-3) == []  # No metrics: nothing to say.


def test_merge_gives_the_logits_of_base_plus_adapters(lora_run, tmp_path, capsys):
  workdir, _ = lora_run
  out = tmp_path / "merged"
  assert cli.main(["lora", "merge", "--workdir", str(workdir), "--out", str(out)]) == 0
  assert not [p for p in checkpoint_paths(out) if "_lora_" in p]  # Plain, full weights.
  tokens = (jnp.arange(32, dtype=jnp.int32).reshape(2, 16) * 7) % 256
  merged, tuned = opened(out), opened(workdir)
  assert merged.config.finetune.lora is None and merged.step == STEPS
  assert not merged.transforms.metadata() and not nnx.state(merged.model, nnx.LoRAParam)
  np.testing.assert_allclose(logits(merged.model, tokens), logits(tuned.model, tokens),
                             atol=MERGE_TOLERANCE, rtol=MERGE_TOLERANCE)
  assert cli.main(["eval", "--workdir", str(out)]) == 0
  before = sorted(p.relative_to(out) for p in out.rglob("*"))
  capsys.readouterr()
  assert cli.main(["lora", "merge", "--workdir", str(workdir), "--out", str(out)]) == 2
  assert "already has checkpoints" in capsys.readouterr().err
  assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.slow
def test_lora_on_an_fsdp_mesh_of_4_devices_trains_like_one_device(base, lora_run, tmp_path):
  """The frozen base is sharded over the mesh and the adapters train across it: the
  same losses as on one device (float32 sums in another order: last bits only)."""
  overrides = lora_overrides(base, "mesh.data=1", "mesh.fsdp=-1", "mesh.rules=fsdp")
  sharded = run_on_devices("lora_on_mesh", tmp_path, overrides, devices=4)
  assert sharded > 0  # Some weights really are split over the 4 devices.
  expected = dict(train_losses(lora_run[0]))
  losses = dict(train_losses(tmp_path))
  assert losses.keys() == expected.keys()
  np.testing.assert_allclose(list(losses.values()), list(expected.values()), rtol=1e-5)


@pytest.mark.parametrize("extra, error", [
    (["model.d_model=48"], r"base run finetune\.base=.* does not fit this config: .*embedding"),
    (["finetune.lora.rank=20"], r"finetune\.lora\.rank=20 is larger than the width \(16\)"),
    (["finetune.lora.modules=nothing_here"], r"finetune\.lora\.modules='nothing_here' matches no"),
])
def test_a_base_or_rank_that_does_not_fit_is_refused(base, tmp_path, capsys, extra, error):
  command = ["train", "lm-tiny", "--workdir", str(tmp_path), *TINY, *lora_overrides(base, *extra)]
  assert cli.main(command) == 2
  assert re.search(error, capsys.readouterr().err)
  assert steps_on_disk(tmp_path) == []


def test_lora_with_qat_is_refused(base, tmp_path, capsys):
  command = ["train", "lm-tiny", "--workdir", str(tmp_path), *TINY, "quant.qat=w8",
             *lora_overrides(base)]
  assert cli.main(command) == 2
  assert ("quant.qat=w8 and finetune.lora (a quantized base is finetune.lora.quantize_base) "
          "each apply a Qwix provider") in capsys.readouterr().err
  assert steps_on_disk(tmp_path) == []


def test_a_missing_base_is_refused(tmp_path, capsys):
  command = ["train", "lm-tiny", "--workdir", str(tmp_path / "run"), *TINY,
             *lora_overrides(tmp_path / "never-trained")]
  assert cli.main(command) == 2
  assert "no trained run there" in capsys.readouterr().err
  assert steps_on_disk(tmp_path / "run") == []


def test_a_base_that_changed_or_vanished_stops_the_resume(base, tmp_path, capsys):
  copy = tmp_path / "base"
  shutil.copytree(base, copy)
  run = tmp_path / "run"
  train.run(tiny_config(*lora_overrides(copy)), run, stop_after=5)
  saved = steps_on_disk(run)
  command = ["train", "lm-tiny", "--workdir", str(run), *TINY, *lora_overrides(copy)]
  steps = copy / train.CHECKPOINT_DIR
  (steps / str(STEPS)).rename(tmp_path / "away")  # Step 30 now holds step 25's weights.
  (steps / str(STEPS - 5)).rename(steps / str(STEPS))
  capsys.readouterr()
  assert cli.main(command) == 2
  assert "has changed since this run started" in capsys.readouterr().err
  shutil.rmtree(copy)
  assert cli.main(command) == 2
  assert "are gone" in capsys.readouterr().err
  assert steps_on_disk(run) == saved


def test_a_finished_run_opens_at_another_param_dtype_over_its_unchanged_base(base, tmp_path):
  """The checksum is of the base at the dtype the run started with (bfloat16 here): opened
  at float32 (as the issue did), the base is read at bfloat16, checked, then cast."""
  run = tmp_path / "run"
  train.run(tiny_config(*lora_overrides(base, "model.param_dtype=bfloat16", "train.steps=1",
                                        "train.eval_every=0", "train.sample_tokens=0")), run)
  assert opened(run).transforms.metadata()["finetune"]["dtype"] == "bfloat16"
  wide = train.Trainer.open_finished(run, overrides=["model.dtype=float32",
                                                     "model.param_dtype=float32"])
  wide.close()
  params = flat(nnx.state(wide.model, nnx.Param))
  for name, value in flat(nnx.state(opened(base).model, nnx.Param)).items():
    assert params[name].dtype == np.float32, name  # bfloat16 values, exactly, at float32.
    assert np.array_equal(params[name], value.astype(jnp.bfloat16).astype(np.float32)), name


def test_an_override_a_finished_run_s_base_cannot_take_is_named(base, lora_run):
  """model.d_model changes the adapters' shapes; model.vocab_size only the frozen base's
  (400 rows are padded to 512, where the base has 384)."""
  for field, value in (("model.d_model", 48), ("model.vocab_size", 400)):
    with pytest.raises(CheckpointMismatchError, match=rf"config fields differ from the "
                       rf"checkpoint's: {re.escape(field)}: \d+ in the checkpoint, {value} now"):
      train.Trainer.open_finished(lora_run[0], overrides=[f"{field}={value}"])


@pytest.mark.slow
def test_qlora_trains_adapters_over_an_int8_base(base, tmp_path):
  extra = lora_overrides(base, "finetune.lora.quantize_base=w8", "train.steps=2",
                         "train.eval_every=0", "train.sample_tokens=0")
  result = train.run(tiny_config(*extra), tmp_path / "run")
  assert np.isfinite(result["loss"])
  tuned = opened(tmp_path / "run")
  params = flat(nnx.state(tuned.model, nnx.Param))
  assert params["layers/0/mlp/up_proj/kernel/array/qvalue"].dtype == np.int8
  assert not [p for p in checkpoint_paths(tmp_path / "run") if "qvalue" in p]  # Base not saved.
  out = lora_merge.merge(tmp_path / "run", tmp_path / "merged")
  tokens = jnp.arange(16, dtype=jnp.int32)[None] % 256
  np.testing.assert_allclose(logits(opened(out).model, tokens), logits(tuned.model, tokens),
                             atol=MERGE_TOLERANCE, rtol=MERGE_TOLERANCE)


def test_full_fine_tuning_starts_from_the_base(base, lora_run, tmp_path):
  extra = [f"finetune.base={base}", "data.paths=[json/*]", "train.steps=2",
           "train.sample_tokens=0"]
  train.run(tiny_config(*extra), tmp_path)
  first = [r for r in train.read_metrics(tmp_path) if r["split"] == "eval"][0]
  lora_first = [r for r in train.read_metrics(lora_run[0]) if r["split"] == "eval"][0]
  assert first["step"] == 0  # The base on the new text, as LoRA's step 0 (B = 0) sees it.
  assert first["eval_loss"] == pytest.approx(lora_first["eval_loss"], abs=1e-5)
  tuned = opened(tmp_path)
  assert tuned.transforms.metadata()["finetune"]["step"] == STEPS
  assert not nnx.state(tuned.model, nnx.LoRAParam)  # Every parameter trains: no adapters.


@pytest.mark.parametrize("overrides, error", [
    (["finetune.lora.rank=4"], "finetune.lora needs finetune.base"),
    (["finetune.base=x", "finetune.lora.rank=0"], "rank must be >= 1"),
    (["finetune.base=x", "finetune.lora.modules=("], "is not a regex"),
    (["finetune.base=x", "finetune.lora.quantize_base=w8a8"], "weight-only scheme"),
    (["finetune.base=x", "finetune.lora.quantize_base=int3"], "unknown quantization scheme"),
])
def test_bad_finetune_config_is_named(overrides, error):
  with pytest.raises(config.ConfigError, match=error):
    config.load("lm-tiny", overrides=overrides)


def test_lora_without_an_action_exits_2(capsys):
  assert cli.main(["lora"]) == 2
  assert "lora merge --workdir" in capsys.readouterr().err


def test_the_preset_fine_tunes_lm_tiny_on_other_text():
  tuned, base = config.load("lm-tiny-lora"), config.load("lm-tiny")
  assert tuned.model == base.model and tuned.finetune.base == "runs/lm-tiny"
  assert tuned.data.source == "stdlib" and tuned.data.paths == ("logging/*",)
