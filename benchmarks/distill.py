"""Does a teacher help? lm-tiny's model distilled from an lm-small run, against lm-tiny alone.

The embedded pair (README: `train lm-small`, then `train lm-tiny-distill`): a teacher
trained at lm-small's size, then two students at lm-tiny's size from the same seed, on the
same tokens for the same steps: lm-tiny (the next byte alone) and lm-tiny-distill (half the
teacher's distribution, forward KL, half the next byte). The figure is each student's
held-out cross-entropy of the next byte (`eval_lm_loss`, nats per byte) at the end, and the
teacher's; the distilled student should end lower. Not a timed test: losses, not speed.

    python benchmarks/distill.py            # each of the three runs 600 steps of 8 x 128
                                            # bytes: about 20 minutes on 2 cores
    python benchmarks/distill.py --quick    # a smoke test: tiny models (the figures mean nothing)

Writes the figures (each run's steps, seconds and held-out losses) to
`results/distill.json`; `--workdir` keeps the runs (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import tempfile
import time

import common

from jax_ai_stack.recipes import config, train

QUIET = ["train.progress=false", "train.sample_tokens=0"]
FULL = {"teacher": ["train.steps=600", "train.eval_every=600", "checkpoint.save_every=600",
                    "optim.warmup_steps=50", "data.batch_size=8", "data.seq_len=128",
                    "data.max_documents=400"],
        "student": []}
"""lm-small trained on lm-tiny's corpus and sequence length; the students as their presets."""
TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=4", "train.eval_batches=1"]
QUICK = {"teacher": [*TINY, "model.d_model=64", "train.steps=4", "train.eval_every=4",
                     "checkpoint.save_every=4"],
         "student": [*TINY, "train.steps=4", "train.eval_every=4", "checkpoint.save_every=4"]}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny models, a few steps")
  parser.add_argument("--workdir", type=pathlib.Path,
                      help="where the three runs go (default: a temporary folder)")
  common.add_out_argument(parser, "distill")
  args = parser.parse_args(argv)
  size = QUICK if args.quick else FULL
  with contextlib.ExitStack() as stack:
    root = args.workdir or pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
    teacher = _train("lm-small", size["teacher"], root / "teacher")
    plain = _train("lm-tiny", size["student"], root / "plain")
    distilled = _train("lm-tiny-distill", [f"finetune.distill.teacher={root / 'teacher'}",
                                           *size["student"]], root / "distilled")
  gain = plain["eval_lm_loss"] - distilled["eval_lm_loss"]
  results = {**common.header("distill"), "mode": "quick" if args.quick else "full",
             "teacher": teacher, "plain": plain, "distilled": distilled,
             "distilled_minus_plain": -gain}
  print(f"held-out nats per byte after {plain['steps']} steps: lm-tiny {plain['eval_lm_loss']:.3f}"
        f", lm-tiny-distill {distilled['eval_lm_loss']:.3f} ({-gain:+.3f}); the teacher "
        f"(lm-small, {teacher['steps']} steps) {teacher['eval_lm_loss']:.3f}")
  common.write(results, args.out)
  return results


def _train(preset: str, overrides: list[str], workdir: pathlib.Path) -> dict:
  """One run of `preset` into `workdir`: its steps, seconds and last held-out losses."""
  started = time.perf_counter()
  recipe = config.load(preset, overrides=[*overrides, *QUIET])
  final = train.run(recipe, workdir)
  seconds = time.perf_counter() - started
  figures = {"preset": preset, "overrides": overrides, "steps": recipe.train.steps,
             "seconds": seconds, "eval_loss": final["eval_loss"],
             "eval_lm_loss": final.get("eval_lm_loss", final["eval_loss"])}
  print(f"{preset}: {json.dumps(figures)}", flush=True)
  return figures


if __name__ == "__main__":
  main()
