"""Where a reinforcement-learning step's time goes, against an SFT step on the same tokens.

lm-tiny-grpo's step (16 prompts x 8 completions of up to 16 tokens, rows of 64, the
lm-tiny model, a KL penalty: `rl.beta=0.04`, so the reference model is used) over a base
of lm-tiny trained one step (the timing needs no trained policy). `--steps` steps through
the Trainer after one that compiles, each split into:

  rollout    `Rollouts.sample`: prompts encoded, the engine's sampling, replies decoded
  engine     the part of rollout inside `inference.Engine.run`
  scoring    `Rollouts._score`: the rewards
  update     the optimizer step on the rollout batch (the reference's forward pass inside)

and, on the last rollout batch, on their own:

  reference  the reference model's forward pass (what the KL penalty adds to update)
  sft        an SFT step (`objectives.lm_loss`, the same model and optimizer) on its rows

Reports seconds per step of each, the RL step against the SFT step, and the rollout's new
tokens/s with and without what it does around the engine (for the engine alone on other
workloads: `benchmarks/engine.py`).

    python benchmarks/rl.py            # lm-tiny-grpo's shape, 5 steps
    python benchmarks/rl.py --quick    # a smoke test: a tiny model, 2 prompts x 2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import common
import jax
from flax import nnx

from jax_ai_stack.recipes import config, inference, step, train
from jax_ai_stack.recipes.tasks import objectives

SIZE = ["model.num_layers=4"]  # lm-tiny's (the preset's) model.
QUICK = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=64", "data.batch_size=2", "rl.num_generations=2",
         "rl.max_completion_tokens=4"]
COMMON = ["train.eval_every=0", "train.progress=false", "train.sample_tokens=0",
          "checkpoint.save_every=1000", "data.max_documents=40"]


class Timer:
  """Seconds and counts per named part, for the steps after `start()`."""

  def __init__(self):
    self.seconds, self.tokens, self.on = defaultdict(float), defaultdict(int), False

  def wrap(self, name: str, fn, *, blocks: bool = False, counts=None):
    def timed(*args, **kwargs):
      started = time.perf_counter()
      out = fn(*args, **kwargs)
      if blocks:
        out = jax.block_until_ready(out)
      if self.on:
        self.seconds[name] += time.perf_counter() - started
        if counts is not None:
          self.tokens[name] += counts(out)
      return out
    return timed


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=common.positive_int, default=5, help="timed RL steps")
  parser.add_argument("--quick", action="store_true", help="a tiny model, 2 timed steps")
  common.add_out_argument(parser, "rl")
  args = parser.parse_args(argv)
  size, steps = (QUICK, 2) if args.quick else (SIZE, args.steps)
  with tempfile.TemporaryDirectory() as scratch:
    base = f"{scratch}/base"
    base_size = [o for o in size if o.startswith("model.")]
    train.run(config.load("lm-tiny", overrides=[*base_size, *COMMON, "train.steps=1"]), base)
    rl = config.load("lm-tiny-grpo", overrides=[
        *size, *COMMON, f"finetune.base={base}", "rl.beta=0.04", f"train.steps={steps + 1}"])
    trainer = train.Trainer.open(rl, f"{scratch}/rl", resume="never")
    try:
      results = measure(trainer, steps)
    finally:
      trainer.close()
  rl_step = sum(results["seconds_per_step"][k] for k in ("rollout", "scoring", "update"))
  results = {**common.header("rl"), "steps": steps, **results,
             "rl_step_s": rl_step, "rl_vs_sft_step": rl_step / results["seconds_per_step"]["sft"]}
  print(f"RL step on {results['device']}: {results['rows']} rows of {results['seq_len']} "
        f"tokens ({results['prompts']} prompts x {results['generations']} completions)")
  for name, seconds in results["seconds_per_step"].items():
    print(f"  {name:<10}{seconds * 1000:>10.1f} ms")
  print(f"  RL step {rl_step * 1000:.1f} ms = {results['rl_vs_sft_step']:.1f} SFT steps on the "
        f"same rows; rollout {results['rollout_tokens_per_s']:,.0f} new tokens/s "
        f"({results['engine_tokens_per_s']:,.0f} inside the engine)")
  common.write(results, args.out)
  return results


def measure(trainer: train.Trainer, steps: int) -> dict:
  """The timed steps and the parts timed on their own (see the module)."""
  timer, batches = Timer(), []
  rollouts = trainer.task.rollouts
  new_tokens = lambda samples: sum(len(s.tokens) for s in samples)  # noqa: E731
  rollouts.sample = timer.wrap("rollout", rollouts.sample, counts=new_tokens)
  rollouts._score = timer.wrap("scoring", rollouts._score)  # pylint: disable=protected-access
  train_step = trainer.train_step

  def update(state, batch):
    batches[:] = [batch]
    return train_step(state, batch)

  trainer.train_step = timer.wrap("update", update, blocks=True)
  engine_run = inference.Engine.run
  with contextlib.ExitStack() as undo:
    inference.Engine.run = timer.wrap(
        "engine", engine_run, counts=lambda done: sum(len(c.tokens) for c in done))
    undo.callback(setattr, inference.Engine, "run", engine_run)
    jax.block_until_ready(trainer.run_step())  # Compiles the engine and the step.
    timer.on = True
    for _ in range(steps):
      jax.block_until_ready(trainer.run_step())
  per_step = {name: timer.seconds[name] / steps
              for name in ("rollout", "engine", "scoring", "update")}
  batch = batches[0]
  step.merge(trainer.model, trainer.optimizer, trainer.state)
  reference = trainer.transforms.reference_model(trainer.model)
  forward = nnx.jit(lambda m, b: objectives.target_logps(m, b["inputs"], b["targets"]))
  per_step["reference"] = _median_s(lambda: forward(reference, batch))
  sft_batch = {k: v for k, v in batch.items()
               if k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
  sft_step, _, state = step.make_steps(trainer.model, trainer.optimizer, objectives.lm_loss)
  holder = [state]

  def one_sft_step():
    holder[0], metrics = sft_step(holder[0], sft_batch)
    return metrics

  per_step["sft"] = _median_s(one_sft_step)
  rows, seq_len = batch["inputs"].shape
  return {"rows": int(rows), "seq_len": int(seq_len),
          "prompts": trainer.config.data.batch_size,
          "generations": trainer.config.rl.num_generations,
          "seconds_per_step": per_step,
          "rollout_tokens_per_s": timer.tokens["rollout"] / timer.seconds["rollout"],
          "engine_tokens_per_s": timer.tokens["engine"] / timer.seconds["engine"]}


def _median_s(fn, rounds: int = 5) -> float:
  """Median seconds of `fn` (blocked on) over `rounds` runs after one that compiles."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(rounds):
    started = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - started)
  return statistics.median(times)


if __name__ == "__main__":
  main()
  sys.exit(0)
