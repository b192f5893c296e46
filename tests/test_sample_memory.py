"""The end-of-run sample's decoding call, measured from XLA's compiled program: a LoRA run
decodes with a merged copy of its weights, a full run with its own."""

from __future__ import annotations

import jax
from flax import nnx

from jax_ai_stack.recipes import config, sample_memory, tasks

BFLOAT16 = ["model.param_dtype=bfloat16", "model.dtype=bfloat16", "model.num_layers=2",
            "model.d_model=128", "model.mlp_dim=512", "data.seq_len=32", "train.sample_tokens=16"]


def abstract_run(*overrides: str):
  task = tasks.for_config(config.load("lm-tiny", overrides=[*BFLOAT16, *overrides]))
  transforms = task.model_transforms()
  return task, transforms, nnx.eval_shape(lambda: transforms.apply(task.build_model(0)))


def weight_bytes(model) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model)))


def test_a_lora_run_decodes_a_merged_copy_and_a_full_run_its_own_weights():
  full = sample_memory.of_run(*abstract_run())
  task, transforms, lora_model = abstract_run("finetune.base=/nowhere", "finetune.lora.rank=4")
  lora = sample_memory.of_run(task, transforms, lora_model)
  plain = nnx.eval_shape(lambda: task.build_model(0))
  # The same decoding program; the LoRA run's holds the merged weights beside its state.
  assert lora - full == weight_bytes(plain)


def test_on_a_cpu_the_decoding_call_holds_float32_copies_of_bfloat16_weights():
  task, _, model = abstract_run()
  held = sample_memory.decoding_bytes(task, model, shared=True)
  assert held >= 2 * weight_bytes(model)  # XLA:CPU multiplies bfloat16 in float32.
  task, _, model = abstract_run("model.param_dtype=float32", "model.dtype=float32")
  assert sample_memory.decoding_bytes(task, model, shared=True) < weight_bytes(model)
