"""Does the chunked head keep a large vocabulary's loss small? Chunked against unchunked.

The loss of a language model needs the log-probability of each target, not the
logits: `models.head.target_logps` makes the logits a chunk of positions at a
time and makes them again in the backward pass; `models.head.linear_target_logps`
(the decoder's, on one device) also goes over the vocabulary in tiles in the
backward pass, so no chunk makes the head's whole [D, V] gradient. This compiles,
from the same hidden states and head, the next-token loss and its gradient (with
respect to both) three ways:

  unchunked  log softmax of the whole [B, T, V] float32 logits (the old loss)
  chunked    `target_logps` with `--chunk` positions per chunk (any head)
  tiled      `linear_target_logps`: chunks, and tiles of `--vocab-tile` in the backward

and reports the memory each program needs beyond its inputs and outputs (XLA's
`memory_analysis` temporaries: the head and its gradient are the model's and
the same both ways), their time, and how far the chunked loss and gradients
are from the unchunked ones. **Targets** at Gemma 3's vocabulary (262,144),
d_model 1,152, 2 x 1,024 tokens: the loss's memory at most 1/4 of the
unchunked, loss within 1e-6 relative, gradients within 1e-5, time within 10%.

    python benchmarks/chunked_loss.py              # V 262144, D 1152, B 2, T 1024, chunk 256
    python benchmarks/chunked_loss.py --quick      # a tiny shape: a smoke test
    python benchmarks/chunked_loss.py --topology v5e:2x2   # compiled for a chip, bytes only

With `--topology` (libtpu or the CUDA plugin at the row's pin) each way is compiled for one
chip of that topology, which this machine lacks, and only its bytes are reported (XLA's peak
heap where the chip's compiler says it), with, on a TPU, tokamax's
`linear_softmax_cross_entropy_loss` (its Mosaic kernel) beside: nothing runs, so there is no
time and no error to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_ai_stack.recipes.models.head import LinearHead, linear_target_logps, target_logps

SHAPE = {"vocab": 262_144, "d_model": 1_152, "batch": 2, "tokens": 1_024, "chunk": 256,
         "vocab_tile": 8_192}
QUICK = {"vocab": 512, "d_model": 32, "batch": 2, "tokens": 64, "chunk": 16, "vocab_tile": 128}
MEMORY_RATIO = 0.25
"""Chunked peak memory at most this share of the unchunked."""
LOSS_RTOL, GRAD_RTOL, TIME_RATIO = 1e-6, 1e-5, 1.10


def losses(shape: dict[str, int], dtype=jnp.float32):
  """{name: loss(hidden, head, targets)} for each way, the mean next-token cross-entropy, the
  head's matmul in `dtype`."""
  def logits_of(head):
    return lambda x: (x @ head).astype(jnp.float32)

  def unchunked(hidden, head, targets):
    logits = logits_of(head)(hidden)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def chunked(hidden, head, targets):
    return -target_logps(logits_of(head), hidden, targets, shape["chunk"]).mean()

  def tiled(hidden, head, targets):
    linear = LinearHead(shape["vocab"], dtype)
    return -linear_target_logps(linear, hidden, head, targets, shape["chunk"],
                                vocab_tile=shape["vocab_tile"]).mean()

  return {"unchunked": unchunked, "chunked": chunked, "tiled": tiled}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, value in SHAPE.items():
    parser.add_argument(f"--{name.replace('_', '-')}", type=common.positive_int, default=value)
  parser.add_argument("--rounds", type=common.positive_int, default=3, help="timed rounds")
  parser.add_argument("--quick", action="store_true", help="a tiny shape, one round")
  common.add_out_argument(parser, "chunked_loss")
  parser.add_argument("--topology", help="compile for one chip of this topology (v5e:2x2, "
                      "h100:1): bytes only")
  args = parser.parse_args(argv)
  shape = QUICK if args.quick else {name: getattr(args, name) for name in SHAPE}
  if args.topology:
    return on_chip(shape, args.topology, args.out)
  rounds = 1 if args.quick else args.rounds

  keys = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(keys[0], (shape["batch"], shape["tokens"], shape["d_model"]))
  head = jax.random.normal(keys[1], (shape["d_model"], shape["vocab"])) * shape["d_model"] ** -0.5
  targets = jax.random.randint(keys[2], (shape["batch"], shape["tokens"]), 0, shape["vocab"])
  compiled, memory, values = {}, {}, {}
  for name, loss in losses(shape).items():
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled[name] = step.lower(hidden, head, targets).compile()
    analysis = compiled[name].memory_analysis()
    memory[name] = {"temporaries": analysis.temp_size_in_bytes,
                    "arguments": analysis.argument_size_in_bytes,
                    "outputs": analysis.output_size_in_bytes}
    values[name] = jax.device_get(compiled[name](hidden, head, targets))
  times = common.interleaved_ms(
      {name: (lambda c=c: c(hidden, head, targets)) for name, c in compiled.items()}, rounds)
  ms = {name: statistics.median(t) for name, t in times.items()}

  loss_a, grads_a = values["unchunked"]
  errors = {}
  for name in ("chunked", "tiled"):
    loss_b, grads_b = values[name]
    errors[name] = {
        "loss": abs(float(loss_b) - float(loss_a)) / abs(float(loss_a)),
        "grad": max(float(np.max(np.abs(b - a)) / np.max(np.abs(a)))
                    for a, b in zip(grads_a, grads_b))}
  # The targets are the decoder's loss: the tiled one (`linear_target_logps`).
  loss_error, grad_error = errors["tiled"]["loss"], errors["tiled"]["grad"]
  memory_ratio = memory["tiled"]["temporaries"] / memory["unchunked"]["temporaries"]
  time_ratio = ms["tiled"] / ms["unchunked"]
  results = {
      **common.header("chunked_loss"),
      "shape": shape,
      "bytes": memory,
      "times_ms": times,
      "relative_errors": errors,
      "loss_relative_error": loss_error,
      "grad_relative_error": grad_error,
      "targets": {
          "memory_ratio": common.target(memory_ratio, MEMORY_RATIO),
          "loss_relative_error": common.target(loss_error, LOSS_RTOL),
          "grad_relative_error": common.target(grad_error, GRAD_RTOL),
          "time_ratio": common.target(time_ratio, TIME_RATIO),
      },
  }
  print(f"next-token loss + gradient on {results['device']}: vocabulary {shape['vocab']:,}, "
        f"d_model {shape['d_model']:,}, {shape['batch']} x {shape['tokens']:,} tokens, "
        f"chunks of {shape['chunk']}, vocabulary tiles of {shape['vocab_tile']:,}")
  print(f"{'':<10}{'loss MB':>10}{'ms':>10}")
  for name in compiled:
    print(f"{name:<10}{memory[name]['temporaries'] / 2**20:>10.0f}{ms[name]:>10.1f}")
  for name, figure in results["targets"].items():
    print(f"{name}: {figure['value']:.3g} (target <= {figure['target']:g}: "
          f"{common.verdict(figure['value'], figure['target'])})")
  common.write(results, args.out)
  return results


def on_chip(shape: dict[str, int], name: str, out) -> dict:
  """Each way's bytes compiled for one chip of topology `name` (tokamax's kernel beside on a
  TPU), in bfloat16 as a model computes its head."""
  from jax_ai_stack import kernels, topology  # pylint: disable=g-import-not-at-top

  device = topology.load(name).devices[0]
  placed = jax.sharding.SingleDeviceSharding(device)
  b, t, d, v = shape["batch"], shape["tokens"], shape["d_model"], shape["vocab"]
  spec = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=placed)
  args = spec((b, t, d)), spec((d, v)), spec((b, t), jnp.int32)
  ways = losses(shape, jnp.bfloat16)
  if device.platform == "tpu":
    tokamax = kernels.implementations.import_tokamax()
    ways["tokamax"] = lambda hidden, head, targets: tokamax.linear_softmax_cross_entropy_loss(
        hidden.reshape(-1, d), targets.reshape(-1), head, reduction="mean",
        implementation="mosaic_tpu")
  mesh = jax.sharding.Mesh([device], ("one",))
  memory = {}
  for way, loss in ways.items():
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with kernels.compiling_for(device.platform), jax.sharding.use_abstract_mesh(
        mesh.abstract_mesh):
      analysis = step.lower(*args).compile().memory_analysis()
    memory[way] = {"peak": getattr(analysis, "peak_memory_in_bytes", 0),
                   "temporaries": analysis.temp_size_in_bytes,
                   "arguments": analysis.argument_size_in_bytes,
                   "outputs": analysis.output_size_in_bytes}
  results = {**common.header("chunked_loss", device=False), "shape": shape,
             "chip": device.device_kind, "bytes": memory}
  print(f"next-token loss + gradient compiled for one {device.device_kind} (bfloat16): "
        f"vocabulary {v:,}, d_model {d:,}, {b} x {t:,} tokens, chunks of {shape['chunk']}")
  print(f"{'':<10}{'peak MiB':>10}{'temp MiB':>10}")
  for way, figures in memory.items():
    print(f"{way:<10}{figures['peak'] / 2**20:>10.0f}{figures['temporaries'] / 2**20:>10.0f}")
  common.write(results, out)
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
