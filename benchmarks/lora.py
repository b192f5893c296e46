"""LoRA against full fine-tuning: trainable parameters, optimizer state and step time.

In one process, from the same model and on the same batch, it times the
recipe's train step (`recipes.step.make_steps`) three ways:

  full    every parameter trains (`nnx.Optimizer(wrt=nnx.Param)`)
  lora    Qwix LoRA adapters on the attention and MLP projections train,
          the base is frozen (`wrt=nnx.LoRAParam`, gradient of the adapters only)
  qlora   the same adapters over an int8 base (`quantize_base=w8`)

and reports, per variant, the trainable parameters, the optimizer state's
bytes (Adam keeps two moments per trainable parameter: what LoRA saves) and
the median ms/step, with the ratio to full fine-tuning. LoRA still runs the
whole forward and the backward through every layer (activations need their
gradients); it skips the weight gradients of the base and their update, so on
a small model the step is barely faster: its win is memory, and checkpoints
that hold only the adapters.

Timings interleave the variants round by round so that noise from other
processes hits them alike.

    python benchmarks/lora.py                  # the lm-tiny model
    python benchmarks/lora.py --quick          # smoke test (about a second a variant)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes import optim, step
from jax_ai_stack.recipes.finetune.adapters import add_adapters
from jax_ai_stack.recipes.finetune.config import LoraConfig
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.tasks import lm_loss

OPTIM_CONFIG = optim.OptimConfig(weight_decay=0.0)
TOTAL_STEPS = 1_000  # For the schedule only.
RANK = 8

SIZES = {  # name: (model, seq_len, batch_size, rounds)
    "lm-tiny": (DecoderConfig(vocab_size=259, num_layers=4, d_model=128, num_heads=4,
                            num_kv_heads=2, mlp_dim=384, max_seq_len=128), 128, 8, 6),
    "quick": (DecoderConfig.tiny(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                               mlp_dim=64, max_seq_len=16), 16, 2, 2),
}
VARIANTS = {"full": None, "lora": LoraConfig(rank=RANK),
            "qlora": LoraConfig(rank=RANK, quantize_base="w8")}


def make_batch(model: DecoderConfig, seq_len: int, batch_size: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, model.vocab_size, (batch_size, seq_len + 1), np.int32)
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def build(model_config: DecoderConfig, adapters: LoraConfig | None):
  """(train_step, state, trainable parameters, optimizer-state bytes) of one variant."""
  def create():
    model = Decoder(model_config, rngs=nnx.Rngs(0))
    return model if adapters is None else add_adapters(model, adapters, model_config, seed=1)

  model = nnx.jit(create)()  # One compiled init (op by op, each initialiser compiles alone).
  wrt = nnx.Param if adapters is None else nnx.LoRAParam
  optimizer = optim.build_optimizer(OPTIM_CONFIG, model, train_steps=TOTAL_STEPS, wrt=wrt)
  train_step, _, state = step.make_steps(model, optimizer, lm_loss)
  trainable = sum(x.size for x in jax.tree.leaves(nnx.state(model, wrt)))
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(optimizer)))
  return train_step, state, trainable, opt_bytes


def bench_size(name: str, rounds: int) -> dict[str, Any]:
  model_config, seq_len, batch_size, default_rounds = SIZES[name]
  rounds = rounds or default_rounds
  batch = make_batch(model_config, seq_len, batch_size)
  variants = {}
  for variant, adapters in VARIANTS.items():
    train_step, state, trainable, opt_bytes = build(model_config, adapters)
    state, metrics = train_step(state, batch)  # Compile.
    jax.block_until_ready(metrics)
    variants[variant] = {"step": train_step, "state": state,
                         "trainable_params": trainable, "optimizer_state_bytes": opt_bytes,
                         "first_loss": float(metrics["loss"])}
  total = variants["full"]["trainable_params"]

  def step_of(v):
    def step():
      v["state"], metrics = v["step"](v["state"], batch)
      return metrics
    return step

  times = common.interleaved_ms({name: step_of(v) for name, v in variants.items()}, rounds)
  full_ms = statistics.median(times["full"])
  out = {"model_params": total, "tokens_per_step": seq_len * batch_size, "rank": RANK,
         "rounds": rounds, "variants": {}}
  for variant, v in variants.items():
    ms = statistics.median(times[variant])
    out["variants"][variant] = {
        "trainable_params": v["trainable_params"],
        "trainable_fraction": v["trainable_params"] / total,
        "optimizer_state_bytes": v["optimizer_state_bytes"],
        "ms_per_step": ms,
        "ratio_vs_full": ms / full_ms,
        "first_loss": v["first_loss"],
    }
  return out


def print_table(results: dict[str, Any]) -> None:
  for name, size in results["sizes"].items():
    print(f"{name}: {size['model_params']:,} parameters, rank {size['rank']}, "
          f"{size['tokens_per_step']} tokens/step, median of {size['rounds']} rounds")
    print(f"  {'variant':8} {'trainable':>12} {'share':>8} {'opt. state':>12} {'ms/step':>9} "
          f"{'vs full':>8}")
    for variant, v in size["variants"].items():
      print(f"  {variant:8} {v['trainable_params']:>12,} {v['trainable_fraction']:>8.2%} "
            f"{v['optimizer_state_bytes'] / 1e6:>10.2f}MB {v['ms_per_step']:>9.2f} "
            f"{v['ratio_vs_full']:>8.2f}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds")
  parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=None)
  parser.add_argument("--repeats", type=int, default=0, help="timed rounds (default per size)")
  common.add_out_argument(parser, "lora")
  args = parser.parse_args(argv)
  args.sizes = args.sizes or (["quick"] if args.quick else ["lm-tiny"])
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  results = {
      **common.header("lora"),
      "flax": flax.__version__,
      "optimizer": OPTIM_CONFIG.name,
      "quick": args.quick,
      "sizes": {name: bench_size(name, args.repeats) for name in args.sizes},
  }
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
