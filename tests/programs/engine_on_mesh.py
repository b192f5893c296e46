"""On 8 devices (JAX fixes the count at start): the generation engine with a reference
checkpoint read onto a mesh, against the same engine on one device.

argv: the reference checkpoint's folder, the mesh as MeshConfig's fields (JSON), and
optionally the paged attention the mesh's engine decodes with (default: the plan's, xla
here; pallas_gpu runs JAX's GPU kernel in interpret mode, a kernel XLA cannot partition)."""

import json
import pathlib
import re
import sys

import numpy as np

from jax_ai_stack import kernels
from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.inference import engine as engine_module
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.sharding_config import MeshConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multidevice import load_on_mesh  # noqa: E402

directory, mesh_fields = sys.argv[1], json.loads(sys.argv[2])
paged = sys.argv[3] if len(sys.argv) > 3 else "auto"
one = hf.load_model(directory)
model = load_on_mesh(directory, MeshConfig(**mesh_fields),
                     attention=kernels.AttentionPlan(("auto",), "the test", paged=paged))
rng = np.random.default_rng(0)
vocab = one.config.vocab_size
requests = [Request(tuple(int(t) for t in rng.integers(0, vocab, n)), 6,
                    temperature=0 if i % 2 else 1.0, seed=i, top_logprobs=2)
            for i, n in enumerate((3, 17, 9, 30, 5, 40, 12, 2, 26))]
# Nine for eight slots, 24 pages of 16 positions (a request holds 1-3): some wait.
settings = dict(max_slots=8, max_len=64, page_size=16, max_pages=24)


def counted(engine: Engine) -> list[int]:
  """Counts the engine's prefill calls: [calls]."""
  calls, prefill = [0], engine._prefill  # pylint: disable=protected-access

  def call(*args):
    calls[0] += 1
    return prefill(*args)

  engine._prefill = call  # pylint: disable=protected-access
  return calls


alone = Engine(one, **settings)
alone_calls = counted(alone)
expected = alone.run(requests)
engine = Engine(model, **settings)
prefill_calls = counted(engine)
got = engine.run(requests)
state = engine._cache  # pylint: disable=protected-access
layer_keys = (state[0] if isinstance(state, tuple) else state)["keys"]
# The decoding step's collectives that move pages ([..., page_size, head_dim]): none, when
# each replica reads its own pool.
idle = np.zeros(8, np.int32)
compiled = engine._steps.lower(  # pylint: disable=protected-access
    engine._params, state, idle, idle,  # pylint: disable=protected-access
    np.zeros((8, 4), np.int32), idle, *engine._settings([None] * 8)).compile().as_text()
collectives = (re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(", line)
               for line in compiled.splitlines())
tail = f"{engine.page_size},{one.config.resolved_head_dim}]"
moved = [found[1] for found in collectives if found and tail in found[1]]
print(json.dumps({
    "tokens": [c.tokens for c in got], "expected": [c.tokens for c in expected],
    "logprobs": max(abs(a - b) for x, y in zip(got, expected)
                    for a, b in zip(x.logprobs, y.logprobs)),
    "cache": str(layer_keys.sharding.spec), "replicas": engine.replicas,
    "shape": list(layer_keys.shape), "pages_moved": moved,
    "on_a_device": list(layer_keys.addressable_shards[0].data.shape),
    "pages_in_use": engine.pages_in_use, "peak_pages": engine.peak_pages,
    "prefill_calls": prefill_calls[0], "prefill_calls_one_device": alone_calls[0]}))
