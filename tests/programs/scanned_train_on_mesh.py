"""On 8 devices (JAX fixes the count at start): lm-tiny with a scanned layer stack, trained.

argv: the workdir, the overrides (JSON)."""

import json
import pathlib
import sys

from jax_ai_stack.recipes import train

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training_helpers import tiny_config  # noqa: E402

workdir = sys.argv[1]
config = tiny_config(*json.loads(sys.argv[2]))
train.run(config, workdir)
trainer = train.Trainer.open(config, workdir)
trainer.close()
kernel = trainer.state[0]["layers"]["attention"]["q_proj"]["kernel"].get_value()
print(json.dumps({"losses": [r["loss"] for r in train.read_metrics(workdir)
                             if r["split"] == "train"],
                  "spec": [s if s is None or isinstance(s, str) else list(s)
                           for s in kernel.sharding.spec]}))
