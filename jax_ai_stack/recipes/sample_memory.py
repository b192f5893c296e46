"""The end-of-run sample's memory on this host's CPU, read from XLA's compiled program.

A run that samples at its end (`train.sample_tokens`) decodes while its train state is still
held: a LoRA run with its adapters merged into a copy of the base (Qwix adds them only
inside `__call__`, not in `decode`), and on a CPU with XLA's float32 copies of every
bfloat16 weight, hoisted out of the decoding loop. At Qwen3-0.6B's shapes that is 3.4 GiB
of temporaries beside 1.1 GiB of weights, above a LoRA step's whole plan, so the plan counts
it (`memory.MemoryPlan.sampling`): the decoding program compiled for one slot of the
sample's length, its bytes read from `memory_analysis`, as `aot` reads a topology's.

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import config
  >>> task = tasks.for_config(config.load("lm-tiny", overrides=["model.num_layers=1"]))
  >>> model = nnx.eval_shape(lambda: task.build_model(0))
  >>> decoding_bytes(task, model, shared=True) > 0
  True
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jax_ai_stack.recipes import inference, tasks
from jax_ai_stack.recipes.transforms import ModelTransform


def decoding_model(task: tasks.Task, transforms: ModelTransform, model: nnx.Module,
                   plan: Any = None) -> tuple[nnx.Module, bool]:
  """The abstract model a run decodes with, `transforms.inference_model` of its abstract
  `model` (a LoRA run's merge), and whether it holds the run's own weights rather than a copy
  (a full run's; also one without its frozen copy, which shares the arrays). `plan` is the
  run's attention plan, for the untransformed model a merge is built into."""
  shared = []

  def decoding(model: nnx.Module) -> nnx.Module:
    decoded = transforms.inference_model(
        model, lambda: task.build_model(task.config.train.seed, plan))
    own = {id(leaf) for leaf in jax.tree.leaves(nnx.state(model))}
    shared.append(all(id(leaf) in own for leaf in jax.tree.leaves(nnx.state(decoded))))
    return decoded

  return nnx.eval_shape(decoding, model), shared[0]


def of_run(task: tasks.Task, transforms: ModelTransform, model: nnx.Module,
           plan: Any = None) -> int:
  """`decoding_bytes` of the model the run samples with (`decoding_model`)."""
  decoding, shared = decoding_model(task, transforms, model, plan)
  return decoding_bytes(task, decoding, shared=shared)


def decoding_bytes(task: tasks.Task, model: nnx.Module, *, shared: bool) -> int:
  """Bytes the end-of-run sample's decoding call holds beyond the train state, on this
  host's default device: its temporaries and the page pool, and the decoded model's
  weights unless `shared` (the run's own, not a merged copy). `model` is abstract
  (`nnx.eval_shape`); the slot holds a prompt of `data.seq_len` and the sample's tokens."""
  config = task.config
  prompt = (0,) * max(getattr(config.data, "seq_len", 1), 1)
  request = inference.Request(prompt, max_tokens=config.train.sample_tokens)
  engine = inference.Engine(model, max_slots=1,
                            max_len=inference.slot_length([request], config.model.max_seq_len))
  stats = engine.lower("decode").compile().memory_analysis()
  weights = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model)))
  arguments = stats.argument_size_in_bytes - (weights if shared else 0)
  return arguments + stats.temp_size_in_bytes + stats.output_size_in_bytes \
      - stats.alias_size_in_bytes
