"""On 8 devices (JAX fixes the count at start): a run saved on one mesh, restored on another.

argv: `save` or `restore`, the workdir, the .npz of the saved arrays, the overrides (JSON).
`save` trains and writes every leaf of the state to the .npz; `restore` opens the run
and compares its state with the .npz (`test_sharding._restored_as_saved`)."""

import json
import logging
import pathlib
import sys

import jax
import numpy as np

from jax_ai_stack.recipes import train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_sharding import _restored_as_saved  # noqa: E402
from training_helpers import tiny_config  # noqa: E402


def leaves(state):
  return {jax.tree_util.keystr(p, simple=True, separator="."): x
          for p, x in jax.tree_util.tree_leaves_with_path(state)}


def host(x):
  key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  return np.asarray(jax.random.key_data(x) if key else x)


def save(workdir, saved, overrides):
  trainer = train.Trainer.open(tiny_config(*overrides), workdir)
  try:
    trainer.fit()
  finally:
    trainer.close()
  np.savez(saved, **{k: host(x) for k, x in leaves(trainer.state).items()})
  return {"step": trainer.step, "saved": trainer.manager.latest_step(),
          "q_proj": [list(x.sharding.spec) for k, x in leaves(trainer.state).items()
                     if k.endswith("q_proj.kernel.value")]}


def restore(workdir, saved, overrides):
  warnings = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: warnings.append(record.getMessage())
  logging.getLogger("jax_ai_stack").addHandler(handler)
  trainer = train.Trainer.open(tiny_config(*overrides), workdir)
  trainer.close()
  return {**_restored_as_saved(trainer, saved), "warnings": warnings}


phase, workdir, saved, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
print(json.dumps({"save": save, "restore": restore}[phase](workdir, saved, overrides)))
