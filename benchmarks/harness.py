"""Log-likelihood scoring through the lm-evaluation-harness adapter: shared contexts, packed
rows and one request per row, same model, same requests.

Multiple-choice shaped requests (drawn from a seed): a context of 16-400 tokens and four
continuations of 1-24 tokens each, on a tiny Decoder (`HarnessModel._loglikelihood_tokens`,
what the harness's `loglikelihood` calls), timed in one process:

  shared_contexts  `HarnessModel(...)`, the default: each context's keys and values computed
                   once for its four continuations (`share_contexts`)
  packed           `HarnessModel(..., packed=True, share_contexts=False)`: requests fill rows
                   as wide as the longest, each its own segment
  one_per_row      `HarnessModel(..., packed=False, share_contexts=False)`: one request per
                   row, no segment ids, rows sorted by length

Each variant runs once to compile and is then timed. Reports requests per second of each,
the share of row positions that are padding in the two layouts, and the largest difference
between the variants' log-likelihoods (the same arithmetic, other neighbours: within 1e-4).
Target: the default at least `TARGET_DEFAULT` times the faster of the other two.

With `--hf-backend`, the same model exported (`models.hf.save`) and the same requests also
go through the harness's own `hf` backend on transformers (`HFLM`, the same batch size), in
a child process (`hf_harness.py`) run by `--torch-python` (an interpreter with torch,
transformers and lm-eval; default this one): its requests/s, the largest difference of its
log-likelihoods from the adapter's, and the default layout against it (target >= 1x).

    python benchmarks/harness.py            # 256 requests
    python benchmarks/harness.py --quick    # smoke test
    python benchmarks/harness.py --hf-backend --torch-python /tmp/hf/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

import common
from jax_ai_stack.recipes import data
from jax_ai_stack.recipes.evaluation.harness_model import HarnessModel, pack, row_width
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

TARGET_DEFAULT = 1.0
"""`HarnessModel`'s default must be at least this many times as fast as the faster of the
other two variants."""
TARGET_VS_HF_BACKEND = 1.0
"""... and at least as fast as the harness's `hf` backend on transformers (when measured)."""
SIZES = {
    "tiny": DecoderConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
                        max_seq_len=512),
    "quick": DecoderConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64,
                         max_seq_len=64),
}
WORKLOADS = {"full": dict(questions=64, context=(16, 400), continuation=(1, 24), batch=8),
             "quick": dict(questions=3, context=(3, 56), continuation=(1, 6), batch=2)}
CHOICES = 4


def requests_for(workload: dict, vocab: int, seed: int = 0) -> list[tuple]:
  """(key, context ids, continuation ids): `CHOICES` continuations of each context."""
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(workload["questions"]):
    context = rng.integers(1, vocab, int(rng.integers(*workload["context"]))).tolist()
    for _ in range(CHOICES):
      continuation = rng.integers(1, vocab, int(rng.integers(*workload["continuation"])))
      requests.append((None, context, continuation.tolist()))
  return requests


def padding_share(requests: Sequence[tuple], batch: int, max_len: int, packed: bool) -> float:
  """The share of the scored rows' positions that are padding, as the adapter lays them out."""
  lengths = [min(len(c) + len(t), max_len + 1) - 1 for _, c, t in requests]
  width = row_width(max(lengths), max_len)
  rows = pack(lengths, width if packed else 0)
  positions = 0
  for start in range(0, len(rows), batch):
    fullest = max(sum(lengths[i] for i in row) for row in rows[start:start + batch])
    positions += batch * row_width(fullest, width)
  return 1 - sum(lengths) / positions


def run_hf_backend(model, requests: Sequence[tuple], batch: int, python: str) -> dict:
  """lm-eval's `HFLM` on `model` exported, in a child process (`hf_harness.py`)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "model"
    hf.save(model, out)
    (out / "requests.json").write_text(json.dumps({"batch": batch, "requests": [
        [context, continuation] for _, context, continuation in requests]}))
    done = subprocess.run([python, str(pathlib.Path(__file__).with_name("hf_harness.py")),
                           str(out)], capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"hf_harness.py failed under {python}:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def measure(size: str, workload: dict, torch_python: str | None = None) -> dict[str, Any]:
  config = SIZES[size]
  model = Decoder(config, rngs=nnx.Rngs(0))
  requests = requests_for(workload, config.vocab_size)
  tokenizer = data.ByteTokenizer()
  settings = {"shared_contexts": {}, "packed": dict(packed=True, share_contexts=False),
              "one_per_row": dict(packed=False, share_contexts=False)}
  variants = {name: HarnessModel(model, tokenizer, batch_size=workload["batch"], **kwargs)
              for name, kwargs in settings.items()}
  default, layouts = "shared_contexts", ("packed", "one_per_row")
  scores, seconds = {}, {}
  for name, harness in variants.items():
    harness._loglikelihood_tokens(requests, disable_tqdm=True)  # Compiles its programs.
    started = time.perf_counter()
    scores[name] = harness._loglikelihood_tokens(requests, disable_tqdm=True)
    seconds[name] = time.perf_counter() - started
  rates = {name: len(requests) / s for name, s in seconds.items()}
  gap = max(abs(a[0] - b[0]) for name in variants for a, b in zip(scores[name], scores[default]))
  other = max(layouts, key=rates.get)
  versus = {}
  if torch_python:
    theirs = run_hf_backend(model, requests, workload["batch"], torch_python)
    rates["hf_backend"] = len(requests) / theirs["seconds"]
    versus = {"hf_backend": {
        "versions": {k: theirs[k] for k in ("lm_eval", "transformers", "torch")},
        "largest_loglikelihood_gap": max(abs(a[0] - b[0])
                                         for a, b in zip(scores[default], theirs["scores"])),
        "same_greedy": [s[1] for s in scores[default]] == [s[1] for s in theirs["scores"]]},
        "default_vs_hf_backend": common.target(rates[default] / rates["hf_backend"],
                                               TARGET_VS_HF_BACKEND, at_least=True)}
  return {
      "model": dataclasses.asdict(config),
      "requests": len(requests), "batch_size": workload["batch"],
      "seconds": seconds, "requests_per_s": rates,
      "padding_share": {name: padding_share(requests, workload["batch"], config.max_seq_len,
                                            name == "packed") for name in layouts},
      "largest_loglikelihood_gap": gap,
      "same_greedy": all([s[1] for s in scores[name]] == [s[1] for s in scores[default]]
                         for name in variants),
      "default": default, "best_other": other,
      "packed_vs_one_per_row": rates["packed"] / rates["one_per_row"],
      "default_vs_other": common.target(rates[default] / rates[other], TARGET_DEFAULT,
                                        at_least=True),
  } | versus


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="benchmarks/harness.py",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a smoke test: 12 tiny requests")
  parser.add_argument("--hf-backend", action="store_true",
                      help="also time the harness's hf backend on the exported model")
  parser.add_argument("--torch-python", default=sys.executable,
                      help="the interpreter with torch, transformers and lm-eval (default: this "
                           "one)")
  common.add_out_argument(parser, "harness")
  args = parser.parse_args(argv)
  size = "quick" if args.quick else "tiny"
  workload = WORKLOADS["quick" if args.quick else "full"]
  record = {**common.header("harness"), **common.versions(), "workload": workload,
            "sizes": {size: measure(size, workload,
                                    args.torch_python if args.hf_backend else None)}}
  if not args.hf_backend:
    record["hf_backend"] = "not measured (--hf-backend)"
  result = record["sizes"][size]
  rates, ratio = result["requests_per_s"], result["default_vs_other"]["value"]
  print(f"{size}: shared contexts {rates['shared_contexts']:,.1f} requests/s, packed "
        f"{rates['packed']:,.1f}, one per row {rates['one_per_row']:,.1f}; the default "
        f"({result['default']}) against {result['best_other']} {ratio:.2f} (target >= "
        f"{TARGET_DEFAULT}: "
        f"{common.verdict(ratio, TARGET_DEFAULT, at_least=True)}); padding "
        f"{result['padding_share']['packed']:.0%} against "
        f"{result['padding_share']['one_per_row']:.0%}; largest log-likelihood gap "
        f"{result['largest_loglikelihood_gap']:.1e}", flush=True)
  if "hf_backend" in result:
    versus = result["default_vs_hf_backend"]["value"]
    print(f"{size}: hf backend {rates['hf_backend']:,.1f} requests/s; {result['default']} / hf "
          f"backend {versus:.2f} (target >= {TARGET_VS_HF_BACKEND}: "
          f"{common.verdict(versus, TARGET_VS_HF_BACKEND, at_least=True)}); largest gap "
          f"{result['hf_backend']['largest_loglikelihood_gap']:.1e}, same greedy flags: "
          f"{result['hf_backend']['same_greedy']}", flush=True)
  common.write(record, args.out)
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
  sys.exit(0)
