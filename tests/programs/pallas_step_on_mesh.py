"""On 8 devices (JAX fixes the count at start): lm-tiny with a Pallas kernel under fsdp_tp.

argv: the workdir, the overrides (JSON)."""

import json
import pathlib
import sys

from jax_ai_stack.recipes import train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_sharding import _step_program  # noqa: E402
from training_helpers import tiny_config  # noqa: E402

workdir, overrides = sys.argv[1], json.loads(sys.argv[2])
config = tiny_config(*overrides)
train.run(config, workdir)
trainer = train.Trainer.open(config, workdir)
try:
  program = _step_program(trainer)
finally:
  trainer.close()
print(json.dumps({
    "losses": [r["loss"] for r in train.read_metrics(workdir) if r["split"] == "train"],
    "kernel": trainer.attention_choice.name,
    "shard_map": "shard_map" in program and "pallas_call" in program,
    "constraints": program.count("sharding_constraint"),
}))
