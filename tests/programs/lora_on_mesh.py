"""On a mesh (JAX fixes the device count at start): a LoRA run trained; how many arrays split.

argv: the workdir, the overrides (JSON)."""

import json
import pathlib
import sys

import jax

from jax_ai_stack.recipes import train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training_helpers import tiny_config  # noqa: E402

workdir, overrides = sys.argv[1], json.loads(sys.argv[2])
train.run(tiny_config(*overrides), workdir)
trainer = train.Trainer.open_finished(workdir)
trainer.close()
leaves = jax.tree.leaves(trainer.model)
print(json.dumps(sum(not leaf.sharding.is_fully_replicated for leaf in leaves)))
