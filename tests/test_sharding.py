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
  specs = run_on_devices("""
      import json, jax, optax
      from flax import nnx
      from jax_ai_stack.recipes import sharding
      from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

      config = DecoderConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                           vocab_size=256, max_seq_len=16)
      def create():
        model = Decoder(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      state = nnx.state(nnx.eval_shape(create))
      out = {}
      for rules, sizes in [("dp", {}), ("fsdp", {"data": 2, "fsdp": 4}),
                           ("fsdp_tp", {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2})]:
        mesh_config = sharding.MeshConfig(rules=rules, **sizes)
        mesh = sharding.build_mesh(mesh_config)
        shardings = sharding.state_shardings(state, mesh, sharding.logical_rules(mesh_config))
        flat = {jax.tree_util.keystr(p, simple=True, separator="/"): list(s.spec)
                for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
        out[rules] = {k: v for k, v in flat.items()
                      if k.endswith(("q_proj/kernel/value", "up_proj/kernel/value", "embed/embedding/value"))}
      print(json.dumps(out))
  """)
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
  rows = run_on_devices("""
      import json, numpy as np
      from jax_ai_stack.recipes import sharding
      mesh_config = sharding.MeshConfig(data=2, fsdp=4)
      mesh = sharding.build_mesh(mesh_config)
      local = {"inputs": np.arange(8 * 3).reshape(8, 3)}
      shardings = sharding.batch_shardings({"inputs": ("batch", "length")}, {"inputs": (8, 3)},
                                           mesh, sharding.logical_rules(mesh_config))
      batch = sharding.global_batch(local, shardings, 8)
      print(json.dumps({"spec": list(batch["inputs"].sharding.spec),
                        "shards": len(batch["inputs"].addressable_shards),
                        "rows": np.asarray(batch["inputs"]).tolist()}))
  """)
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
  results = run_on_devices(f"""
      import json, sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      import jax
      from jax_ai_stack.recipes import train
      from training_helpers import tiny_config
      out = {{}}
      for name, mesh in [("dp", ["mesh.rules=dp"]),
                         ("fsdp", ["mesh.rules=fsdp", "mesh.data=2", "mesh.fsdp=4"]),
                         ("fsdp_tp", ["mesh.rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4",
                                      "mesh.tensor=2"])]:
        workdir = {str(tmp_path)!r} + "/" + name
        result = train.run(tiny_config(*{MESH_TINY!r}, *mesh), workdir)
        trainer = train.Trainer.open(tiny_config(*{MESH_TINY!r}, *mesh), workdir)
        trainer.close()
        state = dict(jax.tree_util.tree_leaves_with_path(trainer.state))
        spec = lambda suffix: [list(v.sharding.spec) for k, v in state.items()
                               if jax.tree_util.keystr(k, simple=True, separator="/").endswith(suffix)]
        out[name] = {{
            "losses": [r["loss"] for r in train.read_metrics(workdir) if r["split"] == "train"],
            "eval_loss": result["eval_loss"],
            "q_proj": spec("0/layers/0/attention/q_proj/kernel/value"),
            "q_proj_mu": spec("/mu/layers/0/attention/q_proj/kernel/value"),
            "devices": len(trainer.placement.mesh.devices.flat),
        }}
      print(json.dumps(out))
  """)
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
  result = run_on_devices(f"""
      import json, sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      from jax_ai_stack.recipes import train
      from training_helpers import tiny_config
      from test_sharding import _step_program

      config = tiny_config(*{overrides!r}, "mesh.rules=fsdp_tp", "mesh.data=2", "mesh.fsdp=2",
                           "mesh.tensor=2")
      workdir = {str(tmp_path / "mesh")!r}
      train.run(config, workdir)
      trainer = train.Trainer.open(config, workdir)
      try:
        program = _step_program(trainer)
      finally:
        trainer.close()
      print(json.dumps({{
          "losses": [r["loss"] for r in train.read_metrics(workdir) if r["split"] == "train"],
          "kernel": trainer.attention_choice.name,
          "shard_map": "shard_map" in program and "pallas_call" in program,
          "constraints": program.count("sharding_constraint"),
      }}))
  """)
  assert result["kernel"] == "pallas_gpu"
  np.testing.assert_allclose(result["losses"], expected, rtol=2e-5)
  assert result["shard_map"]
  assert result["constraints"] >= 3  # After the embedding, on attention and MLP outputs.


_RESHARD_HELPERS = """
    import json, logging, sys
    sys.path.insert(0, {here!r})
    import jax, numpy as np
    from jax_ai_stack.recipes import train
    from training_helpers import tiny_config

    def leaves(state):
      return {{jax.tree_util.keystr(p, simple=True, separator="."): x
               for p, x in jax.tree_util.tree_leaves_with_path(state)}}

    def host(x):
      key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      return np.asarray(jax.random.key_data(x) if key else x)
"""


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
  helpers = _RESHARD_HELPERS.format(here=str(pathlib.Path(__file__).parent))
  fsdp = ["mesh.rules=fsdp", "mesh.data=1", "mesh.fsdp=8"]
  first = run_on_devices(helpers + f"""
    trainer = train.Trainer.open(tiny_config(*{MESH_TINY!r}, *{fsdp!r}), {str(workdir)!r})
    try:
      trainer.fit()
    finally:
      trainer.close()
    np.savez({str(saved)!r}, **{{k: host(x) for k, x in leaves(trainer.state).items()}})
    print(json.dumps({{"step": trainer.step, "saved": trainer.manager.latest_step(),
                      "q_proj": [list(x.sharding.spec) for k, x in leaves(trainer.state).items()
                                 if k.endswith("q_proj.kernel.value")]}}))
  """)
  assert first == {"step": 4, "saved": 4, "q_proj": [["fsdp", None, None]] * 3}  # Param, mu, nu.

  fsdp_tp = ["mesh.rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
  second = run_on_devices(helpers + f"""
    from test_sharding import _restored_as_saved
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("jax_ai_stack").addHandler(handler)
    trainer = train.Trainer.open(tiny_config(*{MESH_TINY!r}, *{fsdp_tp!r}), {str(workdir)!r})
    trainer.close()
    print(json.dumps({{**_restored_as_saved(trainer, {str(saved)!r}), "warnings": warnings}}))
  """)
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
