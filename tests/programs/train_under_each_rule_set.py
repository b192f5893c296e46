"""On 8 devices (JAX fixes the count at start): lm-tiny trained under each rule set.

argv: the folder of the runs (one per rule set), the overrides (JSON)."""

import json
import pathlib
import sys

import jax

from jax_ai_stack.recipes import train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training_helpers import tiny_config  # noqa: E402

folder, overrides = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, mesh in [("dp", ["mesh.rules=dp"]),
                   ("fsdp", ["mesh.rules=fsdp", "mesh.data=2", "mesh.fsdp=4"]),
                   ("fsdp_tp", ["mesh.rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4",
                                "mesh.tensor=2"])]:
  workdir = folder + "/" + name
  result = train.run(tiny_config(*overrides, *mesh), workdir)
  trainer = train.Trainer.open(tiny_config(*overrides, *mesh), workdir)
  trainer.close()
  state = dict(jax.tree_util.tree_leaves_with_path(trainer.state))

  def spec(suffix):
    return [list(v.sharding.spec) for k, v in state.items()
            if jax.tree_util.keystr(k, simple=True, separator="/").endswith(suffix)]

  out[name] = {
      "losses": [r["loss"] for r in train.read_metrics(workdir) if r["split"] == "train"],
      "eval_loss": result["eval_loss"],
      "q_proj": spec("0/layers/0/attention/q_proj/kernel/value"),
      "q_proj_mu": spec("/mu/layers/0/attention/q_proj/kernel/value"),
      "devices": len(trainer.placement.mesh.devices.flat),
  }
print(json.dumps(out))
