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

With `--trl`, the step against TRL's `GRPOTrainer` on the same machine (`versus_trl`): a
Qwen3 with a 1,000-token byte-level BPE tokenizer and ChatML (made here, saved with
`models.hf.save`), at the tiny (3.4M parameters) and 25M sizes, imported with `import-hf`
on our side and loaded by transformers in a child process (`trl_grpo.py`, run by
`--torch-python`: an interpreter with torch, transformers and trl, default this one; e.g.
`python3.11 -m venv ~/trl && ~/trl/bin/pip install torch==2.13.0 transformers==5.12.1
trl==1.16.0`, the versions measured in benchmarks/README.md). Both
train it on the same 8 prompts x 8 completions of up to 32 tokens a step ("Is N even?"),
temperature 1, no KL penalty, GRPO's loss, Adam at 1e-5, with the same two plain-Python
rewards (`trl_grpo.parity`, `trl_grpo.length`). Reports seconds per step (the median after
the first) split into rollout, generation and scoring, completion tokens per second and the
mean completion length of each. **Target: ours / TRL <= 0.5** at both sizes, with mean
completion lengths within 5% of each other. Where torch or trl is missing, one line says so
and only our side is measured.

    python benchmarks/rl.py            # lm-tiny-grpo's shape, 5 steps
    python benchmarks/rl.py --quick    # a smoke test: a tiny model, 2 prompts x 2
    python benchmarks/rl.py --trl --torch-python ~/trl/bin/python   # against TRL, 10 steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import common
import jax
from flax import nnx

from jax_ai_stack.recipes import config, hf_cli, inference, step, train
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.tasks import objectives

SIZE = ["model.num_layers=4"]  # lm-tiny's (the preset's) model.
QUICK = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=64", "data.batch_size=2", "rl.num_generations=2",
         "rl.max_completion_tokens=4"]
COMMON = ["train.eval_every=0", "train.progress=false", "train.sample_tokens=0",
          "checkpoint.save_every=1000", "data.max_documents=40"]

TARGET_VS_TRL = 0.5
"""Our RL step's seconds over TRL's must stay at or below this (twice as fast)."""
TRL_SIZES = {  # Qwen3s of 3.4M and 25M parameters, and a smoke test's.
    "tiny": dict(num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, mlp_dim=768),
    "25m": dict(num_layers=8, d_model=512, num_heads=8, num_kv_heads=4, mlp_dim=1536),
    "quick": dict(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64),
}
TRL_WORKLOADS = {
    "full": dict(batch_prompts=8, num_generations=8, max_completion_tokens=32, temperature=1.0,
                 learning_rate=1e-5, seed=0),
    "quick": dict(batch_prompts=2, num_generations=2, max_completion_tokens=4, temperature=1.0,
                  learning_rate=1e-5, seed=0),
}
VOCAB = 1000
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


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
  parser.add_argument("--steps", type=common.positive_int, default=None,
                      help="timed RL steps (default 5; with --trl 10)")
  parser.add_argument("--quick", action="store_true", help="a tiny model, 2 timed steps")
  parser.add_argument("--trl", action="store_true",
                      help="against TRL's GRPOTrainer (a Qwen3 with a BPE tokenizer; 10 steps)")
  parser.add_argument("--sizes", default="tiny,25m", help="with --trl: the sizes (tiny,25m)")
  parser.add_argument("--torch-python", default=sys.executable,
                      help="with --trl: an interpreter with torch, transformers and trl")
  common.add_out_argument(parser, "rl")
  args = parser.parse_args(argv)
  if args.trl:
    return main_versus_trl(args)
  size, steps = (QUICK, 2) if args.quick else (SIZE, args.steps or 5)
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


def chatml_model(out: pathlib.Path, size: str) -> int:
  """A Qwen3 of `size` (seed 0) with a byte-level BPE tokenizer of `VOCAB` tokens trained on
  the standard library's source and ChatML turns, saved as a Hugging Face directory `out`;
  its parameters' count."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  library = sorted(pathlib.Path(json.__file__).parent.parent.glob("*.py"))[:80]
  texts = [f.read_text(errors="replace") for f in library]
  tokenizer.train_from_iterator([*texts, *(p["messages"][0]["content"] for p in parity_prompts())],
                                trainer)
  files = out.with_name(out.name + "-tokenizer")
  files.mkdir(parents=True)
  tokenizer.save(str(files / "tokenizer.json"))
  (files / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
  ids = {"eos_token_id": tokenizer.token_to_id("<|im_end|>"),
         "pad_token_id": tokenizer.token_to_id("<|endoftext|>"), "bos_token_id": None}
  model = Decoder(DecoderConfig(kind="qwen3", vocab_size=VOCAB, max_seq_len=128,
                                **TRL_SIZES[size]), rngs=nnx.Rngs(0))
  hf.save(model, out, tokenizer=files / "tokenizer.json", token_ids=ids,
          generation_config={k: v for k, v in ids.items() if v is not None})
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def parity_prompts(count: int = 512) -> list[dict]:
  """'Is N even?' as a user turn, with the answer the `parity` reward reads."""
  return [{"messages": [{"role": "user", "content": f"Is {n} even?"}],
           "answer": "yes" if n % 2 == 0 else "no"} for n in range(count)]


def versus_trl(size: str, workload: dict, steps: int, python: str | None,
               scratch: pathlib.Path) -> dict:
  """Our RL step and TRL's (when `python` imports trl) on one model, prompts and rewards."""
  model = scratch / f"hf-{size}"
  parameters = chatml_model(model, size)
  prompts = scratch / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(p) + "\n" for p in parity_prompts()))
  base = scratch / f"base-{size}"
  hf_cli.import_hf(model, base, overrides=["data.max_documents=40", "train.progress=false"])
  rl = config.load(config_file=base / "config.yaml", overrides=[
      *COMMON, f"finetune.base={base}", "data.source=prompts", f"data.paths=[{prompts}]",
      "data.seq_len=64", f"data.batch_size={workload['batch_prompts']}",
      f"rl.num_generations={workload['num_generations']}",
      f"rl.max_completion_tokens={workload['max_completion_tokens']}",
      f"rl.temperature={workload['temperature']}", "rl.beta=0",
      "rl.rewards=[trl_grpo:parity,trl_grpo:length]", "optim.name=adamw",
      f"optim.learning_rate={workload['learning_rate']}", "optim.schedule=constant",
      "optim.warmup_steps=0", "optim.weight_decay=0", f"train.seed={workload['seed']}",
      f"train.steps={steps + 1}"])
  trainer = train.Trainer.open(rl, scratch / f"ours-{size}", resume="never")
  try:
    ours = measure(trainer, steps, extras=False)
  finally:
    trainer.close()
  completions = workload["batch_prompts"] * workload["num_generations"]
  ours_step = statistics.median(ours["step_seconds"][1:])
  result = {"parameters": parameters,
            "ours": {**ours, "step_s": ours_step,
                     "tokens_per_s": ours["mean_completion_length"] * completions / ours_step}}
  if python is None:
    return result
  spec = {**workload, "steps": steps, "prompts": parity_prompts()}
  (model / "spec.json").write_text(json.dumps(spec))
  done = subprocess.run([python, str(pathlib.Path(__file__).with_name("trl_grpo.py")),
                         str(model)], capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"trl_grpo.py failed under {python}:\n{done.stderr[-3000:]}")
  theirs = json.loads(done.stdout.strip().splitlines()[-1])
  trl_step = statistics.median(theirs["step_seconds"][1:])
  lengths = theirs.pop("completion_lengths")
  trl_length = sum(lengths) / len(lengths)
  theirs.update(step_s=trl_step, mean_completion_length=trl_length,
                tokens_per_s=trl_length * completions / trl_step,
                seconds_per_step={name: statistics.median(times[1:])
                                  for name, times in theirs.pop("part_seconds").items()})
  gap = abs(ours["mean_completion_length"] - trl_length) / trl_length
  return {**result, "trl": theirs,
          "ours_vs_trl": common.target(ours_step / trl_step, TARGET_VS_TRL),
          "completion_length_gap": common.target(gap, 0.05)}


def trl_python(python: str) -> str | None:
  """`python` if it imports torch, transformers and trl; else None, said in one line."""
  try:
    check = subprocess.run([python, "-c", "import torch, transformers, trl"],
                           capture_output=True, text=True, check=False)
  except OSError as e:
    missing = f"{type(e).__name__}: {e.strerror}"
  else:
    if check.returncode == 0:
      return python
    missing = (check.stderr.strip().splitlines() or [f"exit code {check.returncode}"])[-1]
  print(f"TRL's column skipped: {python} cannot import torch, transformers and trl ({missing}); "
        "name an interpreter that can with --torch-python", flush=True)
  return None


def main_versus_trl(args: argparse.Namespace) -> dict:
  """`--trl`: our step against TRL's at each size (see the module)."""
  sizes = ["quick"] if args.quick else args.sizes.split(",")
  if unknown := set(sizes) - set(TRL_SIZES):
    raise SystemExit(f"--sizes: no size {sorted(unknown)}; choose from {sorted(TRL_SIZES)}")
  workload = TRL_WORKLOADS["quick" if args.quick else "full"]
  steps = 2 if args.quick else args.steps or 10
  python = trl_python(args.torch_python)
  record = {**common.header("rl"), **common.versions(), "versus": "trl", "steps": steps,
            "workload": workload, "sizes": {}}
  for size in sizes:
    with tempfile.TemporaryDirectory() as scratch:
      result = versus_trl(size, workload, steps, python, pathlib.Path(scratch))
    record["sizes"][size] = result
    ours = result["ours"]
    print(f"{size} ({result['parameters'] / 1e6:.1f}M): ours {ours['step_s'] * 1000:,.0f} ms a "
          f"step, {ours['tokens_per_s']:,.0f} tokens/s, mean completion "
          f"{ours['mean_completion_length']:.1f} tokens; "
          + ", ".join(f"{k} {v * 1000:,.0f} ms" for k, v in ours["seconds_per_step"].items()),
          flush=True)
    if "trl" in result:
      trl, versus = result["trl"], result["ours_vs_trl"]
      print(f"{size}: TRL {trl['trl']} {trl['step_s'] * 1000:,.0f} ms a step, "
            f"{trl['tokens_per_s']:,.0f} tokens/s, mean completion "
            f"{trl['mean_completion_length']:.1f} tokens; "
            + ", ".join(f"{k} {v * 1000:,.0f} ms" for k, v in trl["seconds_per_step"].items())
            + f"\n{size}: ours / TRL {versus['value']:.2f} (target <= {TARGET_VS_TRL}: "
            f"{common.verdict(versus['value'], TARGET_VS_TRL)}); completion lengths differ by "
            f"{result['completion_length_gap']['value']:.1%} (target <= 5%)", flush=True)
  common.write(record, args.out)
  return record


def measure(trainer: train.Trainer, steps: int, *, extras: bool = True) -> dict:
  """The timed steps (each one's wall seconds, the first compiling) and, with `extras`, the
  parts timed on their own (see the module)."""
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
    started = time.perf_counter()
    jax.block_until_ready(trainer.run_step())  # Compiles the engine and the step.
    step_seconds = [time.perf_counter() - started]
    timer.on = True
    for _ in range(steps):
      started = time.perf_counter()
      jax.block_until_ready(trainer.run_step())
      step_seconds.append(time.perf_counter() - started)
  per_step = {name: timer.seconds[name] / steps
              for name in ("rollout", "engine", "scoring", "update")}
  timed = {"step_seconds": step_seconds, "seconds_per_step": per_step,
           "rollout_tokens_per_s": timer.tokens["rollout"] / timer.seconds["rollout"],
           "engine_tokens_per_s": timer.tokens["engine"] / timer.seconds["engine"],
           "mean_completion_length": timer.tokens["rollout"] / steps / len(batches[0]["inputs"])}
  if not extras:
    return timed
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
  return {**timed, "rows": int(rows), "seq_len": int(seq_len),
          "prompts": trainer.config.data.batch_size,
          "generations": trainer.config.rl.num_generations}


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
