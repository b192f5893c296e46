"""Does GRPO teach on this row? Held-out exact answers of the reversal demo, before and after.

The embedded RL demo (README: `train lm-tiny-reverse`, then `train lm-tiny-grpo`): a chat
SFT on `chat_reversal`, whose careless teacher stops two replies in three a letter short
("evq -> qv"), so the base reverses words but mostly stops early, however the row's corpus
and numerics fall; then GRPO on `prompts_reversal`, rewarded for the exact answer. The
figure is GRPO's greedy exact answers on held-out words (`eval_reward_exact_answer`) at its
step 0 (the base) and at its end; **target: a gain of at least 0.2**. Exits 1 when missed.

    python benchmarks/rl_demo.py             # CI's check (.ci/run, once per package set):
                                             # SFT from scratch, then GRPO; ~2 min on 2 cores
    python benchmarks/rl_demo.py --presets   # README's chain at the presets' own settings:
                                             # lm-tiny, lm-tiny-reverse, lm-tiny-grpo
    python benchmarks/rl_demo.py --quick     # a smoke test: a tiny model (the gain means nothing)

Writes the figures (before, after, gain, steps and seconds of each run, Python, JAX) to
`results/rl_demo.json`; `--workdir` keeps the runs (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
import sys
import tempfile
import time

import common

from jax_ai_stack.recipes import config, train

TARGET_GAIN = 0.2
QUIET = ["train.progress=false"]
# CI's check: lm-tiny's model trained on the reversals from scratch (no lm-tiny base: the
# time goes to the two runs that matter), then 24 GRPO steps of 8 prompts x 8 replies,
# measured on 64 held-out words. About 2.5 minutes on 2 cores.
NO_SAMPLE = ["train.sample_tokens=0"]
CHECK = {
    "base": None,
    "sft": ["finetune.base=null", *NO_SAMPLE, "train.steps=500", "train.eval_every=500",
            "checkpoint.save_every=500"],
    "grpo": ["data.batch_size=8", *NO_SAMPLE, "train.steps=24", "train.eval_every=24",
             "train.eval_batches=8", "checkpoint.save_every=24"],
}
PRESETS = {"base": [], "sft": [], "grpo": []}  # README's chain as the presets have it.
TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", *NO_SAMPLE]
QUICK = {
    "base": None,
    "sft": ["finetune.base=null", *TINY, "data.seq_len=64", "train.steps=4",
            "train.eval_every=4", "checkpoint.save_every=4"],
    "grpo": [*TINY, "data.batch_size=2", "rl.num_generations=2", "rl.max_completion_tokens=8",
             "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
             "checkpoint.save_every=2"],
}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", action="store_true",
                      help="README's chain at the presets' settings (about 4 minutes on 2 cores)")
  parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
  parser.add_argument("--workdir", type=pathlib.Path,
                      help="where the three runs go (default: a temporary folder)")
  common.add_out_argument(parser, "rl_demo")
  args = parser.parse_args(argv)
  size, mode = ((QUICK, "quick") if args.quick else (PRESETS, "presets") if args.presets
                else (CHECK, "check"))
  with contextlib.ExitStack() as stack:
    root = args.workdir or pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
    results = {**common.header("rl_demo"), "row": row(), "mode": mode, **chain(size, root)}
  before, after = results["exact_before"], results["exact_after"]
  results["gain"] = common.target(after - before, TARGET_GAIN, at_least=True)
  print(f"{mode} on {results['row'] or 'no matrix row'}: Python {results['python']}, jax "
        f"{results['jax']}: held-out exact answers {before:.3f} before GRPO -> {after:.3f} "
        f"after {results['grpo']['steps']} steps "
        f"(gain {after - before:+.3f}, target >= {TARGET_GAIN}: "
        f"{common.verdict(after - before, TARGET_GAIN, at_least=True)}); "
        + ", ".join(f"{name} {results[name]['seconds']:.0f} s" for name in ("base", "sft", "grpo")
                    if name in results))
  common.write(results, args.out)
  return results


def row() -> str | None:
  """The name of the compat_matrix.yaml row this environment is (its Python, jax and
  platform), or None."""
  import jax  # pylint: disable=g-import-not-at-top

  from jax_ai_stack import compat  # pylint: disable=g-import-not-at-top

  python = ".".join(platform.python_version_tuple()[:2])
  for each in compat.load_matrix().rows:
    if (each.python == python and dict(each.packages).get("jax") == jax.__version__
        and each.name.endswith(jax.default_backend())):
      return each.name
  return None


def chain(size: dict, root: pathlib.Path) -> dict:
  """Trains the base (unless None), the SFT on it and GRPO on that; the figures of each."""
  out = {}
  base = root / "lm-tiny"
  if size["base"] is not None:
    out["base"] = _train("lm-tiny", [*size["base"], *QUIET], base)
  sft_base = [f"finetune.base={base}"] if size["base"] is not None else []
  out["sft"] = _train("lm-tiny-reverse", [*sft_base, *size["sft"], *QUIET], root / "reverse")
  out["grpo"] = _train("lm-tiny-grpo", [f"finetune.base={root / 'reverse'}", *size["grpo"],
                                        *QUIET], root / "grpo")
  evals = [r for r in train.read_metrics(root / "grpo") if r["split"] == "eval"]
  out["evals"] = [{k: r[k] for k in ("step", "eval_reward_exact_answer", "eval_reward")}
                  for r in evals]
  out["exact_before"] = evals[0]["eval_reward_exact_answer"]
  out["exact_after"] = evals[-1]["eval_reward_exact_answer"]
  return out


def _train(preset: str, overrides: list[str], workdir: pathlib.Path) -> dict:
  """One run of `preset` into `workdir`: its steps, seconds and final metrics."""
  started = time.perf_counter()
  recipe = config.load(preset, overrides=overrides)
  final = train.run(recipe, workdir)
  seconds = time.perf_counter() - started
  keep = {k: v for k, v in final.items() if isinstance(v, (int, float)) and k.startswith(
      ("loss", "eval_loss", "reward", "eval_reward"))}
  print(f"{preset}: {recipe.train.steps} steps in {seconds:.0f} s {json.dumps(keep)}",
        flush=True)
  sample = workdir / "sample.txt"  # The greedy reply to train.sample_prompt, if asked.
  return {"preset": preset, "overrides": overrides, "steps": recipe.train.steps,
          "seconds": seconds, "final": keep,
          "sample": sample.read_text().strip() if sample.is_file() else None}


if __name__ == "__main__":
  figures = main()
  sys.exit(0 if figures["gain"]["met"] or figures["mode"] == "quick" else 1)
