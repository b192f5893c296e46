"""A checkpoint saved, then an exit at once (no close, no wait): exit hooks run in a new process.

argv: the checkpoint folder."""

import sys

import grain
from flax import nnx

from jax_ai_stack.recipes import checkpoint

manager = checkpoint.build_manager(sys.argv[1], checkpoint.CheckpointConfig())
state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
data = iter(grain.MapDataset.range(4).to_iter_dataset())
assert checkpoint.save(manager, 1, state, data, {"step": 1}, force=True)
