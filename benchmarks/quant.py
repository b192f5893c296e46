"""Float against each Qwix quantization scheme: forward latency, parameter bytes, loss.

In one process, from the same Llama and on the same batch, it runs the jitted
forward pass (logits and next-token loss) of

  float   the model as built (or as trained, with --workdir)
  w8      int8 weights (`recipes.finetune.quant.ptq(model, "w8", ...)`)
  w8a8    int8 weights and activations
  w4      int4 MLP weights, int8 elsewhere

and reports, per variant, the median ms per forward pass and the ratio to
float, the parameter bytes (int4 counted packed) and their ratio to float,
and the loss with its delta from float. Timings interleave the variants round
by round, so that noise from other processes hits them alike.

Which numbers mean something: the bytes always; the latency on the device you
serve on (on a CPU, XLA may dequantize int8 weights before the matmul, so the
win is memory, not speed); the loss delta only for a trained model. By default
the model is `DecoderConfig.small()` at initialization, on random tokens, where
every scheme's delta is tiny; pass `--workdir` of a trained LM run to use its
model and its first validation batch instead.

    python benchmarks/quant.py                      # small, at init
    python benchmarks/quant.py --workdir runs/lm-tiny   # a trained run
    python benchmarks/quant.py --quick              # smoke test
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes.finetune import quant
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.tasks import lm_loss

SIZES = {
    "small": (DecoderConfig.small(), 4, 256),  # (model, batch rows, tokens per row)
    "quick": (DecoderConfig.tiny(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                               mlp_dim=64, max_seq_len=16), 2, 16),
}


def random_batch(model: DecoderConfig, rows: int, length: int) -> dict[str, jax.Array]:
  tokens = np.random.default_rng(1).integers(0, model.vocab_size, (rows, length + 1), np.int32)
  return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def from_workdir(workdir: pathlib.Path) -> tuple[Decoder, DecoderConfig, dict[str, jax.Array]]:
  """A trained LM run's model and its first validation batch."""
  from jax_ai_stack.recipes.train import Trainer

  trainer = Trainer.open_finished(workdir, validation=True)
  trainer.close()
  if trainer.config.model.kind != "llama":
    raise SystemExit(f"benchmarks/quant.py: {workdir} trained a {trainer.config.model.kind}, "
                     "not a llama")
  batch = {k: jnp.asarray(v) for k, v in next(iter(trainer.validation)).items()}
  return trainer.model, trainer.config.model, batch


def forward(model: nnx.Module):
  """The jitted loss of `model` on a batch, and its parameter state."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, batch):
    return lm_loss(nnx.merge(graphdef, state), batch)[0]

  return run, state


def bench(models: dict[str, nnx.Module], batch, rounds: int) -> dict[str, dict[str, Any]]:
  runs = {name: forward(model) for name, model in models.items()}
  losses = {name: float(run(state, batch)) for name, (run, state) in runs.items()}  # Compiles.
  times = common.interleaved_ms(
      {name: functools.partial(run, state, batch) for name, (run, state) in runs.items()}, rounds)
  return {name: {"loss": losses[name], "ms": times[name],
                 "param_bytes": quant.param_bytes(models[name])} for name in runs}


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  base = runs["float"]
  base_ms = statistics.median(base["ms"])
  out = {}
  for name, run in runs.items():
    ms = statistics.median(run["ms"])
    out[name] = {
        "ms_per_forward": ms,
        "latency_vs_float": ms / base_ms,
        "param_bytes": run["param_bytes"],
        "bytes_vs_float": run["param_bytes"] / base["param_bytes"],
        "loss": run["loss"],
        "loss_delta": run["loss"] - base["loss"],
        "ms_rounds": run["ms"],
    }
  return out


def print_table(results: dict[str, Any]) -> None:
  print(f"\n{results['model']} ({results['batch']}) on {results['device']}; "
        f"median of {results['rounds']} rounds")
  header = ("variant", "ms/forward", "x float", "param bytes", "x float", "loss", "delta")
  rows = [header]
  for name, r in results["variants"].items():
    rows.append((name, f"{r['ms_per_forward']:.2f}", f"{r['latency_vs_float']:.2f}",
                 f"{r['param_bytes']:,}", f"{r['bytes_vs_float']:.3f}", f"{r['loss']:.4f}",
                 f"{r['loss_delta']:+.4f}"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  for row in rows:
    print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="benchmarks/quant.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", type=pathlib.Path,
                      help="a trained LM run: its model and first validation batch "
                           "(default: DecoderConfig.small() at init, random tokens)")
  parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
  parser.add_argument("--quick", action="store_true", help="smoke test: a 1-layer model, 2 rounds")
  common.add_out_argument(parser, "quant")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds must be >= 1, got {args.rounds}")
  if args.quick:
    args.rounds = 2
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints the table, writes and returns the results."""
  args = parse_args(argv)
  if args.workdir is not None:
    model, config, batch = from_workdir(args.workdir)
    described = f"the model trained in {args.workdir}"
  else:
    config, rows, length = SIZES["quick" if args.quick else "small"]
    model = nnx.jit(lambda: Decoder(config, rngs=nnx.Rngs(0)))()
    batch = random_batch(config, rows, length)
    described = f"Llama {'quick' if args.quick else 'small'} at init"
  model.eval()
  models = {"float": model, **{s: quant.ptq(model, s, config) for s in quant.SCHEMES}}
  results = {
      **common.header("quant"),
      "model": f"{described}, {config.num_params():,} parameters",
      "batch": f"{batch['inputs'].shape[0]} x {batch['inputs'].shape[1]} tokens",
      "rounds": args.rounds,
      "quick": args.quick,
      "variants": summarize(bench(models, batch, args.rounds)),
  }
  print_table(results)
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
