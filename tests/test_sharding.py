"""Meshes and logical-axis rules: sizes, specs, bad input; 8 simulated devices."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import sharding
from jax_ai_stack.recipes.sharding import MeshConfig

from multidevice import run_on_devices


def test_one_size_may_be_the_rest_of_the_devices():
  assert sharding.mesh_shape(MeshConfig(), 8) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
  assert sharding.mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=2), 8) == {
      "data": 1, "fsdp": 4, "expert": 1, "tensor": 2}


def test_sizes_that_do_not_fit_the_devices_say_both_numbers():
  with pytest.raises(ConfigError, match=r"mesh.data=2 x mesh.fsdp=3 x mesh.expert=1 x mesh.tensor=1 = 6 devices, "
                                        r"but there are 8"):
    sharding.mesh_shape(MeshConfig(data=2, fsdp=3), 8)
  with pytest.raises(ConfigError, match="cannot fill 8 devices"):
    sharding.mesh_shape(MeshConfig(data=-1, tensor=3), 8)


def test_bad_sizes_and_axes_are_config_errors():
  with pytest.raises(ValueError, match="at most one of"):
    MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="mesh.tensor must be >= 1"):
    MeshConfig(tensor=0)
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    MeshConfig(rule_overrides={"mlp": ["model"]})


def test_rule_overrides_replace_the_rule_set_s_entry():
  rules = sharding.logical_rules(MeshConfig(rules="fsdp_tp", rule_overrides={"vocab": []}))
  assert rules["vocab"] == () and rules["mlp"] == ("tensor",)


def test_a_dimension_that_does_not_divide_names_the_parameter_shape_and_axis():
  mesh = jax.sharding.AbstractMesh((1, 4, 1, 2), sharding.MESH_AXES)
  rules = sharding.logical_rules(MeshConfig(rules="fsdp_tp"))
  assert sharding.partition_spec(("embed", "mlp"), (8, 6), rules, mesh, what="w") == (
      jax.sharding.PartitionSpec("fsdp", "tensor"))
  with pytest.raises(ConfigError, match=r"layers/0/w has shape \(6, 4\): dimension 0 \('embed', "
                                        r"size 6\) does not divide by mesh axes fsdp of size 4"):
    sharding.partition_spec(("embed", "mlp"), (6, 4), rules, mesh, what="layers/0/w")
  with pytest.raises(ConfigError, match="both map to mesh axis 'tensor'"):
    sharding.partition_spec(("heads", "mlp"), (4, 4), rules, mesh, what="w")


def test_one_device_is_a_single_device_mesh():
  mesh = sharding.build_mesh(MeshConfig())
  assert mesh.devices.size == 1 and set(mesh.axis_names) == set(sharding.MESH_AXES)
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_each_rule_set_places_parameters_and_their_optimizer_state():
  """On 8 devices: the specs the rules say, for parameters and Adam's moments."""
  specs = run_on_devices("rule_set_specs")
  q = "0/layers/0/attention/q_proj/kernel/value"
  up, embed = "0/layers/0/mlp/up_proj/kernel/value", "0/embed/embedding/value"
  assert specs["dp"][q] == [None, None, None]
  assert specs["fsdp"][q] == ["fsdp", None, None]
  assert specs["fsdp_tp"][q] == ["fsdp", "tensor", None]
  assert specs["fsdp_tp"][up] == ["fsdp", "tensor"]
  assert specs["fsdp_tp"][embed] == ["tensor", "fsdp"]
  for rules in specs:  # Adam's first and second moments are split like their parameter.
    for name in (q, up, embed):
      moment = name.replace("0/", "1/opt_state/0/mu/", 1)
      assert specs[rules][moment] == specs[rules][name], (rules, name)


def test_process_shares_become_one_global_batch():
  rows = run_on_devices("global_batch_rows")
  assert rows["spec"] == [["data", "fsdp", "expert"], None] and rows["shards"] == 8
  assert rows["rows"] == np.arange(24).reshape(8, 3).tolist()


MESH_TINY = ["data.batch_size=8", "model.num_heads=4", "model.num_kv_heads=2",
             "train.steps=4", "train.eval_every=2", "train.sample_tokens=0"]


@pytest.mark.every_row  # What jax's partitioner does with each rule set changes with jax.
def test_each_rule_set_trains_like_one_device(tmp_path):
  """lm-tiny for 4 steps on 8 devices under each rule set: the one-device losses.

  Not bitwise: a sharded matmul or gradient sums in another order (partial sums
  per device, then an all-reduce), so float32 results differ in the last bits.
  """
  from jax_ai_stack.recipes import train
  from training_helpers import tiny_config

  single = train.run(tiny_config(*MESH_TINY), tmp_path / "one")
  expected = [r["loss"] for r in train.read_metrics(tmp_path / "one") if r["split"] == "train"]
  results = run_on_devices("train_under_each_rule_set", tmp_path, MESH_TINY)
  for name, result in results.items():
    assert result["devices"] == 8
    np.testing.assert_allclose(result["losses"], expected, rtol=2e-5, err_msg=name)
    np.testing.assert_allclose(result["eval_loss"], single["eval_loss"], rtol=2e-5, err_msg=name)
    assert len(result["q_proj_mu"]) == 1, name
    assert result["q_proj"] == result["q_proj_mu"], name  # Adam's moment lives like its weight.
  assert results["fsdp_tp"]["q_proj"] == [["fsdp", "tensor", None]]
  assert results["dp"]["q_proj"] == [[None, None, None]]


def _step_program(trainer) -> str:
  """The jaxpr of the trainer's train step on its next batch, as text."""
  batch = trainer.placement.batch(next(trainer.train_batches))
  return str(jax.make_jaxpr(trainer.train_step)(trainer.state, batch))


@pytest.mark.slow
def test_fsdp_tp_with_a_pallas_kernel_trains_like_one_device(tmp_path):
  """lm-tiny with `pallas_gpu` (Pallas interpret mode on CPU) under fsdp_tp on
  data 2 x fsdp 2 x tensor 2: the one-device losses (the tolerance above), with
  the kernel in a shard_map and the activations pinned in the sharded step, and
  neither in the one-device step."""
  from jax_ai_stack.recipes import train
  from training_helpers import tiny_config

  overrides = [*MESH_TINY, "model.attention_impl=pallas_gpu"]
  train.run(tiny_config(*overrides), tmp_path / "one")
  expected = [r["loss"] for r in train.read_metrics(tmp_path / "one") if r["split"] == "train"]
  trainer = train.Trainer.open(tiny_config(*overrides), tmp_path / "one")
  try:
    one_device = _step_program(trainer)
  finally:
    trainer.close()
  assert "shard_map" not in one_device and "sharding_constraint" not in one_device
  result = run_on_devices("pallas_step_on_mesh", tmp_path / "mesh",
                          [*overrides, "mesh.rules=fsdp_tp", "mesh.data=2", "mesh.fsdp=2",
                           "mesh.tensor=2"])
  assert result["kernel"] == "pallas_gpu"
  np.testing.assert_allclose(result["losses"], expected, rtol=2e-5)
  assert result["shard_map"]
  assert result["constraints"] >= 3  # After the embedding, on attention and MLP outputs.


def _restored_as_saved(trainer, saved: pathlib.Path) -> dict:
  """How `trainer`'s restored state compares with the arrays saved in `saved` (.npz)."""
  from flax import nnx

  def host(x):
    key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return np.asarray(jax.random.key_data(x) if key else x)

  got = {jax.tree_util.keystr(p, simple=True, separator="."): x
         for p, x in jax.tree_util.tree_leaves_with_path(trainer.state)}
  expected = trainer.placement.state_shardings(nnx.state((trainer.model, trainer.optimizer)))
  with np.load(saved) as arrays:
    differ = [k for k in arrays.files
              if host(got[k]).dtype != arrays[k].dtype or not np.array_equal(host(got[k]), arrays[k])]
    return {
        "step": trainer.step, "leaves": sorted(got) == sorted(arrays.files), "differ": differ,
        "laid_out": [x.sharding for x in jax.tree.leaves(trainer.state)] == jax.tree.leaves(expected),
        "q_proj": [list(x.sharding.spec) for k, x in got.items() if k.endswith("q_proj.kernel.value")],
        "mesh": dict(trainer.placement.mesh.shape),
    }


@pytest.mark.slow
def test_a_checkpoint_restores_bitwise_onto_another_mesh(tmp_path, caplog):
  """Saved under fsdp=8 on 8 devices; opened again (resume auto) under fsdp 4 x
  tensor 2 with the fsdp_tp rules, and on one device: Orbax's sharded restore
  puts every parameter and optimizer leaf back bitwise, laid out as the new
  mesh says, and the changed mesh is no warning (it is not a change of the run)."""
  from jax_ai_stack.recipes import train
  from training_helpers import tiny_config

  workdir, saved = tmp_path / "run", tmp_path / "saved.npz"
  fsdp = ["mesh.rules=fsdp", "mesh.data=1", "mesh.fsdp=8"]
  first = run_on_devices("checkpoint_across_meshes", "save", workdir, saved, [*MESH_TINY, *fsdp])
  assert first == {"step": 4, "saved": 4, "q_proj": [["fsdp", None, None]] * 3}  # Param, mu, nu.

  fsdp_tp = ["mesh.rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
  second = run_on_devices("checkpoint_across_meshes", "restore", workdir, saved,
                          [*MESH_TINY, *fsdp_tp])
  assert second["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
  assert second["q_proj"] == [["fsdp", "tensor", None]] * 3

  with caplog.at_level("WARNING", logger="jax_ai_stack"):
    trainer = train.Trainer.open(tiny_config(*MESH_TINY), workdir)  # This process: one device.
    trainer.close()
  one = {**_restored_as_saved(trainer, saved), "warnings": [r.getMessage() for r in caplog.records]}
  assert one["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
  for result in (second, one):
    assert result["step"] == 4 and result["leaves"] and result["laid_out"], result
    assert result["differ"] == [], result
    assert result["warnings"] == [], result
