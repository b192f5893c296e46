"""`jax-ai-stack kernels`: which attention kernel runs here, and why; autotune.

Prints, for the current backend (or the chip of a --topology this machine does
not have, or a simulated one with --platform), every attention implementation,
whether it is eligible for the given shape and dtype, why not, and the one
chosen. With --autotune, tunes and pins the choice in
`<workdir>/attention_autotune.json` for training and resume to load.

Example: what would run on a TPU (simulated here) for a small shape.
  >>> parse_shape("2,128,8,2,64")
  ((2, 128, 8, 64), (2, 128, 2, 64))
  >>> import argparse
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args = parser.parse_args(
  ...     ["kernels", "--shape", "1,16,2,2,8", "--platform", "tpu", "--implementation", "xla"])
  >>> args.func(args)  # doctest: +ELLIPSIS
  Attention on tpu: q [1,16,2,8] k/v [1,16,2,8] bfloat16, causal
  Order tried (--implementation): xla
  (capability checks only: candidates were not traced)
  <BLANKLINE>
    implementation       eligible  why not / notes
  * xla                  yes
  ...
  Chosen: xla (...)
  grouped matmul (MoE experts): ...
  0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

from jax_ai_stack.errors import UsageError



def default_recipe_shape() -> str:
  """B,T,N,K,H of the default recipe's attention (what `jax-ai-stack train` runs)."""
  from jax_ai_stack.recipes import config

  recipe = config.load(config.DEFAULT_PRESET)
  model, data = recipe.model, recipe.data
  return (f"{data.batch_size},{data.seq_len},{model.num_heads},{model.num_kv_heads},"
          f"{model.resolved_head_dim}")


def register(subparsers) -> None:
  parser = subparsers.add_parser(
      "kernels", help="show which attention kernel is chosen here and why; autotune it",
      description=__doc__.split("\n\n")[1],
  )
  parser.add_argument(
      "--shape", metavar="B,T,N,K,H",
      help="batch, query length, query heads, key/value heads, head dim (default: the "
      "default recipe's, as `jax-ai-stack train` runs it)",
  )
  parser.add_argument("--kv-len", type=int, metavar="S", help="key/value length (default: T)")
  parser.add_argument(
      "--dtype",
      help="float32/f32, bfloat16/bf16, float16/f16 (default: f32 on CPU, bf16 elsewhere)",
  )
  parser.add_argument("--no-causal", dest="causal", action="store_false", help="no causal mask")
  parser.add_argument("--segment-ids", action="store_true", help="with segment ids (packing)")
  parser.add_argument("--local-window", type=int, metavar="W", help="sliding window of W keys back")
  parser.add_argument("--kv-seq-lengths", action="store_true", help="with per-example key lengths")
  parser.add_argument(
      "--implementation", default="auto", metavar="NAMES",
      help="'auto' or comma-separated names to try in order (as attention(implementation=...))",
  )
  parser.add_argument(
      "--topology", metavar="NAME",
      help="the chip of a TPU slice or GPU host this machine does not have, from its "
      "compile-only devices: e.g. v5e:2x2, v6e:4x4, h100:8 (needs libtpu or the CUDA plugin)",
  )
  parser.add_argument(
      "--platform", choices=("cpu", "gpu", "tpu"),
      help="simulate another backend (capability checks only, nothing is traced)",
  )
  parser.add_argument(
      "--device-kind", default="",
      help="with --platform: e.g. 'NVIDIA H100 80GB HBM3', 'TPU v5 lite'",
  )
  parser.add_argument(
      "--compute-capability", help="with --platform gpu: CUDA compute capability, e.g. 9.0"
  )
  parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
  parser.add_argument(
      "--autotune", action="store_true",
      help="run tokamax.autotune, time the eligible kernels, save the choice as JSON"
      " in --workdir",
  )
  parser.add_argument(
      "--workdir", default=".", help="where --autotune writes attention_autotune.json (default: .)"
  )
  parser.set_defaults(func=run_kernels)


def parse_shape(text: str, kv_len: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """"B,T,N,K,H" -> (q_shape [B,T,N,H], k_shape [B,S,K,H]); UsageError if malformed."""
  try:
    values = tuple(int(p) for p in text.split(","))
  except ValueError:
    values = ()
  if len(values) != 5 or min(values) <= 0:
    raise UsageError(f"--shape {text!r} must be five positive ints B,T,N,K,H")
  if kv_len is not None and kv_len <= 0:
    raise UsageError(f"--kv-len {kv_len} must be a positive int")
  batch, q_len, num_heads, num_kv_heads, head_dim = values
  return (batch, q_len, num_heads, head_dim), (batch, kv_len or q_len, num_kv_heads, head_dim)


def _backend(args: argparse.Namespace):
  """The backend of --topology's chip or the simulated one of --platform; None for the
  real one."""
  from jax_ai_stack.kernels.request import Backend, backend_of

  if (args.topology or args.platform) and args.autotune:
    raise UsageError("--autotune measures the real backend; drop --topology and --platform")
  if args.topology:
    if args.platform or args.device_kind or args.compute_capability:
      raise UsageError("--topology names the chip; drop --platform, --device-kind and "
                       "--compute-capability")
    from jax_ai_stack import topology  # pylint: disable=g-import-not-at-top

    topology.host_cpu_only()
    target = topology.load(args.topology)
    if not args.json:
      print(target.describe())
    return backend_of(target.devices[0])
  if args.platform:
    return Backend(args.platform, args.device_kind, args.compute_capability)
  if args.device_kind or args.compute_capability:
    raise UsageError("--device-kind and --compute-capability need --platform")
  return None


def _request(args: argparse.Namespace, shapes: tuple, platform: str):
  """The `Request` the flags describe; UsageError names a bad shape or dtype."""
  from jax_ai_stack.kernels.request import Request

  q_shape, k_shape = shapes
  dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
  try:
    return Request.from_shapes(
        q_shape, k_shape, dtype, causal=args.causal, segment_ids=args.segment_ids,
        local_window=args.local_window, kv_seq_lengths=args.kv_seq_lengths,
    )
  except ValueError as e:
    raise UsageError(str(e)) from None


def _autotune(request, workdir: str) -> int:
  from jax_ai_stack.kernels import autotuning

  if reason := autotuning.autotune_unsupported_reason():
    print(f"error: --autotune is not available: {reason}", file=sys.stderr)
    return 1
  path = pathlib.Path(workdir) / autotuning.AUTOTUNE_FILENAME
  autotuning.autotune([request], path)
  document = json.loads(path.read_text(encoding="utf-8"))
  for entry in document["entries"]:
    times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in entry["times_ms"].items())
    print(f"Autotuned: {entry['implementation']} (forward+backward: {times})")
  print(f"Saved {path}; training and resume load it from the workdir.")
  return 0


def run_kernels(args: argparse.Namespace) -> int:
  from jax_ai_stack.kernels import request as request_lib
  from jax_ai_stack.kernels.experts import choose_grouped_matmul
  from jax_ai_stack.kernels.resolve import resolve_plan

  shapes = parse_shape(args.shape or default_recipe_shape(), args.kv_len)
  if args.autotune and args.implementation != "auto":
    raise UsageError("--autotune chooses among the 'auto' candidates; drop --implementation")
  backend = _backend(args)
  request = _request(args, shapes, (backend or request_lib.current_backend()).platform)
  # The environment counts as for training: the table shows what would run.
  plan = resolve_plan(args.implementation, origin="--implementation", environ=os.environ)
  choice = plan.report(request, backend=backend)

  print(json.dumps(choice.to_dict(), indent=2) if args.json else choice.report())
  if not args.json:  # Mixture-of-experts layers' other kernel (`experts`).
    target = backend or request_lib.current_backend()
    name, why = choose_grouped_matmul("auto", target.platform, target.device_kind)
    print(f"grouped matmul (MoE experts): {name} ({why}); a recipe sets model.moe.grouped_matmul")
    name, why = dataclasses.replace(plan, backend=target).paged_attention()  # The model's.
    print(f"paged attention (the generation engine's decoding): {name} ({why})")
  if choice.name is None:
    print("error: no attention implementation fits; see the table above", file=sys.stderr)
    return 1
  return _autotune(request, args.workdir) if args.autotune else 0
