"""On a mesh (JAX fixes the device count at start): lm-tiny's (step, loss) pairs.

argv: the workdir, the overrides (JSON)."""

import json
import sys

from jax_ai_stack.recipes import config, train

workdir = sys.argv[1]
train.run(config.load("lm-tiny", overrides=json.loads(sys.argv[2])), workdir)
print(json.dumps([(r["step"], r["loss"]) for r in train.read_metrics(workdir)
                  if r["split"] == "train"]))
