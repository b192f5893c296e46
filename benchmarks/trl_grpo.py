"""TRL's side of `rl.py --trl`, in a process of its own; and the rewards both sides use.

So that PyTorch's threads never share a process with JAX's (see torch_process.py), the
parent exports its model with a tokenizer (`models.hf.save`), writes the prompts and the
settings to `DIR/spec.json` and runs `python trl_grpo.py DIR` with an interpreter that has
torch, transformers and trl (`--torch-python`). This runs TRL's `GRPOTrainer` on that model
with the same prompts, rewards (`parity`, `length`, below), group size, completion length,
temperature and optimizer, float32 on the CPU, and prints one JSON object: the versions,
the wall seconds of each optimizer step, and within them the seconds of

  rollout    `_generate_and_score_completions`: prompts encoded, generated, scored
  generate   `_generate_single_turn`: transformers' `generate` on the group's prompts
  scoring    `_calculate_rewards`

and the completions' lengths. `spec.json`: {"prompts": [{"messages": [...], "answer": ...}],
"batch_prompts", "num_generations", "max_completion_tokens", "temperature",
"learning_rate", "steps", "seed"}.

The rewards are plain Python with the signature both trainers call, `f(prompts,
completions, **columns)`; TRL passes a conversation's completion as a list of messages.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time


def _text(completion) -> str:
  return completion if isinstance(completion, str) else completion[-1]["content"]


def parity(prompts, completions, answer, **_) -> list[float]:
  """1 where the reply's first word is the answer ('yes' or 'no'), else 0."""
  return [float(_text(c).strip().lower().startswith(a)) for c, a in zip(completions, answer)]


def length(prompts, completions, **_) -> list[float]:
  """Short replies score higher: 1 for an empty one, 0 from 64 characters on."""
  return [max(0.0, 1.0 - len(_text(c)) / 64) for c in completions]


def main(directory: str) -> dict:
  import datasets
  import torch
  import transformers
  import trl

  directory = pathlib.Path(directory)
  spec = json.loads((directory / "spec.json").read_text())
  steps, group = spec["steps"], spec["num_generations"]
  args = trl.GRPOConfig(
      output_dir=str(directory / "trl"), use_cpu=True, seed=spec["seed"], report_to="none",
      per_device_train_batch_size=spec["batch_prompts"] * group, num_generations=group,
      max_completion_length=spec["max_completion_tokens"], temperature=spec["temperature"],
      beta=0.0, loss_type="grpo", learning_rate=spec["learning_rate"], weight_decay=0.0,
      lr_scheduler_type="constant", max_steps=steps + 1, save_strategy="no", logging_steps=1,
      disable_tqdm=True, bf16=False, dataloader_num_workers=0)
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  rows = [{"prompt": p["messages"], "answer": p["answer"]} for p in spec["prompts"]]
  trainer = trl.GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                            reward_funcs=[parity, length],
                            train_dataset=datasets.Dataset.from_list(rows))
  seconds = {"rollout": [], "generate": [], "scoring": []}
  completion_lengths = []

  def timed(name, fn, after=None):
    def wrapper(*a, **k):
      started = time.perf_counter()
      out = fn(*a, **k)
      seconds[name].append(time.perf_counter() - started)
      if after is not None:
        after(out)
      return out
    return wrapper

  trainer._generate_and_score_completions = timed(  # pylint: disable=protected-access
      "rollout", trainer._generate_and_score_completions)  # pylint: disable=protected-access
  trainer._generate_single_turn = timed(  # pylint: disable=protected-access
      "generate", trainer._generate_single_turn,  # pylint: disable=protected-access
      after=lambda out: completion_lengths.extend(len(ids) for ids in out[0]))
  trainer._calculate_rewards = timed(  # pylint: disable=protected-access
      "scoring", trainer._calculate_rewards)  # pylint: disable=protected-access
  step_seconds = []

  class StepClock(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      self.started = time.perf_counter()  # pylint: disable=attribute-defined-outside-init

    def on_step_end(self, *_, **__):
      step_seconds.append(time.perf_counter() - self.started)

  trainer.add_callback(StepClock())
  trainer.train()
  return {"trl": trl.__version__, "torch": torch.__version__,
          "transformers": transformers.__version__, "threads": torch.get_num_threads(),
          "step_seconds": step_seconds, "part_seconds": seconds,
          "completion_lengths": completion_lengths}


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
