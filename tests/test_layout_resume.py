"""Flipping `model.scan_layers` on a workdir: the resume reads each checkpoint step in
its own layer layout and converts parameters and optimizer moments bitwise (also onto
a mesh, and for a LoRA base), the training goes on, and a genuine mismatch still
exits 2 with today's error, changing nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import grain
import jax
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import cli
from jax_ai_stack.recipes import checkpoint, train
from jax_ai_stack.recipes.models import layer_stack
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

from multidevice import run_on_devices
from training_helpers import TINY, tiny_config, train_losses

LAYERS = ["model.num_layers=2", "train.steps=6", "checkpoint.save_every=2"]
SCANNED = "model.scan_layers=true"


def config(*extra):
  return tiny_config(*LAYERS, *extra)


def cli_train(workdir, *extra) -> int:
  return cli.main(["train", "lm-tiny", "--workdir", str(workdir), *TINY, *LAYERS, *extra])


@pytest.fixture(scope="module")
def unrolled_run(tmp_path_factory) -> pathlib.Path:
  """Six steps that never change layout: what the switching runs are compared with."""
  workdir = tmp_path_factory.mktemp("unrolled")
  train.run(config(), workdir)
  return workdir


def pure(trainer: train.Trainer) -> dict:
  return nnx.to_pure_dict(trainer.state)


def saved(workdir) -> train.Trainer:
  """The newest step as saved (its own config, so its own layout), moments included."""
  trainer = train.Trainer.open_finished(workdir, optimizer_state=True)
  trainer.close()
  return trainer


def moment(tree: dict, name: str, layer: int) -> np.ndarray:
  """Optimizer moment `name` (mu, nu) of layer `layer`'s up_proj kernel, either layout."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    text = jax.tree_util.keystr(path, simple=True, separator="/")
    if text.endswith(f"{name}/layers/{layer}/mlp/up_proj/kernel"):
      return np.asarray(leaf)
    if text.endswith(f"{name}/layers/mlp/up_proj/kernel"):
      return np.asarray(leaf)[layer]
  raise AssertionError(f"no {name} moment in the state")


def files(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("before, after", [([], [SCANNED]), ([SCANNED], [])],
                         ids=["unrolled-to-scanned", "scanned-to-unrolled"])
@pytest.mark.slow
def test_resume_converts_parameters_and_moments_bitwise_then_trains_on(tmp_path, before, after):
  train.run(config(*before), tmp_path, stop_after=2)
  original = saved(tmp_path)
  step_2 = files(tmp_path / train.CHECKPOINT_DIR / "2")

  trainer = train.Trainer.open(config(*after), tmp_path)
  try:
    was, now = ("scanned", "unrolled") if before else ("unrolled", "scanned")
    assert trainer.converted == (f"checkpoint step 2 has the {was} layout; converted to {now} "
                                 f"(model.scan_layers={str(not before).lower()})")
    assert trainer.step == 2
    assert layer_stack.is_scanned(pure(trainer)[0]) == (not before)
    # Converting back gives bitwise the saved state: parameters, moments, step, RNG.
    back, layout = layer_stack.match_layout(pure(trainer), pure(original))
    assert layout == bool(before)
    assert checkpoint.tree_equal(back, pure(original))
    for name in ("mu", "nu"):
      np.testing.assert_array_equal(moment(pure(trainer), name, 1), moment(pure(original), name, 1))
    assert np.any(moment(pure(trainer), "mu", 1))  # Two steps of training made it non-zero.
    assert trainer.fit()["step"] == 6
  finally:
    trainer.close()

  assert files(tmp_path / train.CHECKPOINT_DIR / "2") == step_2  # Never rewritten.
  finished = saved(tmp_path)
  assert finished.step == 6 and finished.converted is None  # Saved in the new layout.
  assert finished.config.model.scan_layers == (not before)
  assert layer_stack.is_scanned(pure(finished)[0]) == (not before)


@pytest.mark.slow
def test_unrolled_scanned_unrolled_ends_close_to_a_run_that_never_switched(
    unrolled_run, tmp_path, capsys):
  train.run(config(), tmp_path, stop_after=2)
  train.run(config(SCANNED), tmp_path, stop_after=4)
  capsys.readouterr()
  assert cli_train(tmp_path) == 0  # Steps 2 (unrolled), 4 (scanned) and 6 (unrolled) on disk.
  out = capsys.readouterr().out
  assert ("checkpoint step 4 has the scanned layout; converted to "
          "unrolled (model.scan_layers=false)\n") in out
  assert "resumed from step 4\n" in out
  mixed, reference = train_losses(tmp_path), train_losses(unrolled_run)
  assert [s for s, _ in mixed] == [s for s, _ in reference] == list(range(1, 7))
  assert mixed[:2] == reference[:2]  # Same layout, same bits.
  # The conversion is bitwise, but the scanned steps compute their gradients in another
  # program than the unrolled model: the final loss is equal up to float32 rounding, not
  # bitwise (jax 0.10.2, CPU: steps 1-5 bitwise, step 6 differs in the last bits).
  np.testing.assert_allclose([l for _, l in mixed], [l for _, l in reference], rtol=1e-4)
  steps = {p.name for p in (tmp_path / train.CHECKPOINT_DIR).iterdir()}
  assert {"2", "4", "6"} <= steps


@pytest.mark.parametrize("extra", [["model.d_model=64"], ["model.num_layers=3"]],
                         ids=["d_model", "num_layers"])
def test_a_genuine_mismatch_with_a_flipped_layout_still_exits_2_and_changes_nothing(
    unrolled_run, capsys, extra):
  before = files(unrolled_run)
  assert cli_train(unrolled_run, SCANNED, *extra) == 2
  err = capsys.readouterr().err
  # A model change is another run: refused by field before any array is read, layout or not.
  assert len(err.splitlines()) == 1 and " in the run, " in err and "keeps its model" in err
  assert "model.scan_layers" not in err  # How the model runs may change in a new phase.
  assert files(unrolled_run) == before


@pytest.mark.slow
def test_a_lora_run_reads_a_scanned_base(tmp_path):
  base = tmp_path / "base"
  train.run(config(SCANNED, "train.steps=2"), base)
  tuned = tmp_path / "lora"
  result = train.run(config(f"finetune.base={base}", "finetune.lora.rank=4", "train.steps=2"),
                     tuned)
  assert result["step"] == 2
  weights = nnx.to_pure_dict(nnx.state(layer_stack.unrolled(saved(base).model), nnx.Param))
  read = nnx.to_pure_dict(nnx.state(saved(tuned).model, nnx.Param))
  kernel = lambda tree: np.asarray(tree["layers"][1]["mlp"]["up_proj"]["kernel"])  # noqa: E731
  np.testing.assert_array_equal(kernel(read), kernel(weights))


def test_on_a_mesh_the_converted_arrays_land_on_the_target_shardings(tmp_path):
  result = run_on_devices("layout_flip_on_mesh", tmp_path)
  assert result["False"] == {"placed": True, "bitwise": True, "converted":
                             "checkpoint step 1 has the unrolled layout; converted to scanned "
                             "(model.scan_layers=true)"}
  assert result["True"] == {"placed": True, "bitwise": True, "converted":
                            "checkpoint step 1 has the scanned layout; converted to unrolled "
                            "(model.scan_layers=false)"}


def test_each_step_is_read_in_its_own_layout_also_past_a_corrupt_one(tmp_path):
  config = DecoderConfig(vocab_size=64, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2,
                       mlp_dim=64, max_seq_len=32, attention_impl="xla")
  unrolled = nnx.state(Decoder(config, rngs=nnx.Rngs(1)))
  scanned = nnx.state(Decoder(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(2)))
  directory = tmp_path / "checkpoints"
  data = lambda: iter(grain.MapDataset.range(4).to_iter_dataset())  # noqa: E731
  with checkpoint.build_manager(directory, checkpoint.CheckpointConfig(keep_last=5)) as manager:
    checkpoint.save(manager, 1, unrolled, data(), {}, force=True)
    checkpoint.save(manager, 2, scanned, data(), {}, force=True)
  abstract = lambda s: nnx.eval_shape(lambda: s)  # noqa: E731

  manager = checkpoint.build_manager(directory, checkpoint.CheckpointConfig(keep_last=5))
  try:
    same = checkpoint.restore(manager, abstract(scanned))
    assert (same.step, same.converted) == (2, None)
    assert checkpoint.tree_equal(same.state, scanned)
    other = checkpoint.restore(manager, abstract(unrolled))
    assert other.step == 2 and "step 2 has the scanned layout" in other.converted
    assert checkpoint.tree_equal(nnx.to_pure_dict(other.state),
                                 layer_stack.unstack_layers(nnx.to_pure_dict(scanned)))
    for path in (directory / "2" / "state").rglob("*"):
      if path.is_file() and path.parent.name == "d":
        path.write_bytes(b"garbage")  # Step 2 unreadable: step 1, in its own layout.
    older = checkpoint.restore(manager, abstract(scanned))
    assert older.step == 1 and "step 1 has the unrolled layout" in older.converted
    assert checkpoint.tree_equal(nnx.to_pure_dict(older.state),
                                 layer_stack.stack_layers(nnx.to_pure_dict(unrolled)))
  finally:
    manager.close()
