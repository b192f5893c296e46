"""On 8 devices (JAX fixes the count at start): moe-tiny trained whole, and stopped and resumed.

argv: the overrides (JSON), the two runs' workdirs by name (JSON: "whole", "stopped")."""

import json
import sys

from jax_ai_stack.recipes import config, train

moe_tiny = config.load("moe-tiny", overrides=json.loads(sys.argv[1]))
runs = json.loads(sys.argv[2])
train.run(moe_tiny, runs["whole"])
train.run(moe_tiny, runs["stopped"], stop_after=4)
train.run(moe_tiny, runs["stopped"])
print(json.dumps({name: [r["loss"] for r in train.read_metrics(workdir)
                         if r["split"] == "train"] for name, workdir in runs.items()}))
