"""On 8 devices (JAX fixes the count at start): the generation engine with a reference
checkpoint read onto a mesh, against the same engine on one device.

argv: the reference checkpoint's folder, then the mesh as MeshConfig's fields (JSON)."""

import json
import pathlib
import sys

import numpy as np

from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.sharding_config import MeshConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multidevice import load_on_mesh  # noqa: E402

directory, mesh_fields = sys.argv[1], json.loads(sys.argv[2])
one, model = hf.load_model(directory), load_on_mesh(directory, MeshConfig(**mesh_fields))
rng = np.random.default_rng(0)
vocab = one.config.vocab_size
requests = [Request(tuple(int(t) for t in rng.integers(0, vocab, n)), 6,
                    temperature=0 if i % 2 else 1.0, seed=i, top_logprobs=2)
            for i, n in enumerate((3, 17, 9, 30, 5))]  # Five for four slots: one waits.
expected = Engine(one, max_slots=4, max_len=64).run(requests)
engine = Engine(model, max_slots=4, max_len=64)
got = engine.run(requests)
keys = engine._keys  # pylint: disable=protected-access
layer_keys = keys[0] if isinstance(keys, tuple) else keys
print(json.dumps({
    "tokens": [c.tokens for c in got], "expected": [c.tokens for c in expected],
    "logprobs": max(abs(a - b) for x, y in zip(got, expected)
                    for a, b in zip(x.logprobs, y.logprobs)),
    "cache": str(layer_keys.sharding.spec)}))
