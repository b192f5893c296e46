"""The rollout: a group of completions per prompt from the generation engine, scored, as the
batch the GRPO-family objective (`tasks.grpo`) trains on.

Each train step's batch of prompt indices (`data.prompts`) becomes
`rl.num_generations` requests per prompt, decoded together by the engine
(`inference.Engine`) with the policy as it is at that step; completion g of
prompt i at step s is sampled with a seed drawn from (train.seed, s, i, g),
so a resumed run samples exactly what the run that never stopped sampled.
Each completion ends at the prompt's end-of-turn (a conversation) or the
tokenizer's EOS (a text prompt), or after `rl.max_completion_tokens` (fewer
where the prompt leaves less room in `data.seq_len + 1`). The rewards
(`rl.rewards`) score the completions' text; their weighted sum gives each
completion its advantage within its group (`grpo.advantages`), less DAPO's soft
overlong penalty where `rl.overlong_buffer` asks. With `rl.dynamic_sampling`,
a group whose rewards are all equal (it teaches nothing) is dropped and the
groups of further prompt batches take its place (up to `rl.max_draws`).

The batch has one row per completion: prompt and completion as
`inputs`/`targets`/`segment_ids`/`positions` [N, L], L the longest's length rounded up
to a power of two, at most data.seq_len (`row_length`), `loss_mask`
on the completion's tokens (its stop token included), `advantages` [N],
`sampler_logps` (the engine's log-probability of each completion token) and
`fresh` [N] (ones: the Trainer zeroes it for the later updates on the same
rollout, `rl.updates_per_rollout`). The
rollout's metrics (`reward`, `reward_<function>`, `reward_std`, the mean
completion length, the share of completions cut at the limit and of groups
whose rewards are all equal: no signal) are logged with the step.

`evaluate` measures the rewards on held-out prompts: one greedy completion
each (`eval_reward`, `eval_reward_<function>`) and a sampled group
(`eval_sampled_reward`), with seeds that are the same at every evaluation.

On several processes each samples the prompts of its own rows of the batch, on
a whole copy of the policy on its first device (gathered once per rollout):
data-parallel rollouts with no collective while decoding. A completion depends
only on its request (the engine is batch-invariant), so the rows are those one
process would sample with the same copy; the metrics are the processes' mean.

Example: (a run's Task builds it: `LanguageModel.rollouts`)
  >>> from jax_ai_stack.recipes import config, tasks
  >>> task = tasks.for_config(config.load("lm-tiny-grpo"))
  >>> task.rollouts.rewards[0].short_name, task.rollouts.splits["train"].num_examples > 0
  ('exact_answer', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes import inference, sharding
from jax_ai_stack.recipes.data import examples
from jax_ai_stack.recipes.data import prompts as prompts_lib
from jax_ai_stack.recipes.data.tokenizers import Tokenizer
from jax_ai_stack.recipes.rl import rewards as rewards_lib
from jax_ai_stack.recipes.tasks import grpo

MAX_SLOTS = 64
"""The most completions the engine decodes at once."""
EVAL_STEP = -1
"""The step in the evaluation's seeds: the same sampled completions at every evaluation."""
NOTICED_GAP = 1e-4
"""A larger `sampler_logp_gap` is said once: the engine's kernels differ from the trainer's
(float32 summed in another order stays near 1e-5 on CPU)."""


@dataclasses.dataclass
class Sample:
  """One completion of one prompt."""

  prompt_ids: np.ndarray
  tokens: list[int]
  logprobs: list[float]
  finish_reason: str
  text: str


class Rollouts:
  """Samples, scores and batches the completions of a run on prompts (see the module)."""

  def __init__(self, config, tokenizer: Tokenizer,
               encode: Callable[[dict], tuple[np.ndarray, tuple[int, ...]]]):
    """`encode`: an item to its prompt's ids and stop ids (`LanguageModel.prompt_encoder`)."""
    self.config, self.rl = config, config.rl
    self.tokenizer, self.encode = tokenizer, encode
    self.splits = prompts_lib.load_prompts(config.data)
    self.rewards = rewards_lib.load(self.rl.rewards, self.rl.resolved_weights)
    self.weights = np.asarray([r.weight for r in self.rewards], np.float32)
    self.limit = min(config.data.seq_len + 1, config.model.max_seq_len)
    self._noticed = False

  def batch(self, model: nnx.Module, draw: Callable[[], dict[str, np.ndarray]], step: int
            ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The training batch of `step` and its metrics; `draw()` gives the next batch of prompt
    indices (several with `rl.dynamic_sampling`: groups whose rewards are all equal are
    dropped and others drawn in their place, up to `rl.max_draws` batches)."""
    group, draws = self.rl.num_generations, self.rl.max_draws if self.rl.dynamic_sampling else 1
    model = sharding.on_this_process(model)
    kept, dropped, wanted, drawn = [], [], None, 0
    while drawn < draws and (wanted is None or len(kept) < wanted):
      indices = [int(i) for i in draw()["prompt_index"]]
      wanted, drawn = wanted or len(indices), drawn + 1
      samples = self.sample(model, "train", indices, group, self.rl.temperature, step)
      scores = self._score("train", indices, group, samples)
      for i in range(len(indices)):
        rows = slice(i * group, (i + 1) * group)
        overlong = self._overlong(samples[rows])
        total = scores[rows] @ self.weights + overlong
        signal = not self.rl.dynamic_sampling or np.ptp(total) > 0
        (kept if signal else dropped).append((samples[rows], scores[rows], overlong, total))
    chosen = (kept + dropped)[:wanted]  # Short of groups with a signal: some without.
    samples = [s for group_samples, *_ in chosen for s in group_samples]
    scores, overlong, groups = (np.stack([group[i] for group in chosen]) for i in (1, 2, 3))
    scores = scores.reshape(len(samples), len(self.rewards))
    advantage = grpo.advantages(groups, self.rl.advantage).reshape(-1)
    metrics = {"completion_tokens": float(np.mean([len(s.tokens) for s in samples])),
               "completions_cut": float(np.mean([s.finish_reason == "length" for s in samples]))}
    if self.rewards:  # (On-policy distillation may score none.)
      metrics.update({"reward": float(groups.mean()),
                      "reward_std": float(groups.std(axis=1).mean()),
                      **{f"reward_{r.short_name}": float(scores[:, i].mean())
                         for i, r in enumerate(self.rewards)},
                      "groups_without_signal": float(np.mean(np.ptp(groups, axis=1) == 0))})
    if self.rl.overlong_buffer:
      metrics["reward_overlong"] = float(overlong.mean())
    if self.rl.dynamic_sampling:
      metrics["groups_dropped"] = len(dropped) / (len(kept) + len(dropped))
      metrics["prompt_batches_drawn"] = float(drawn)
    return self._arrays(samples, advantage), mean_over_processes(metrics)

  def notice(self, metrics: dict[str, float]) -> str | None:
    """The line to print, once, when a step's `sampler_logp_gap` shows the engine's
    log-probabilities differ from the trainer's (kernels), and how the run corrects it."""
    gap = metrics.get("sampler_logp_gap", 0.0)
    if self._noticed or gap <= NOTICED_GAP:
      return None
    self._noticed = True
    cap = self.rl.importance_cap
    correction = (f"truncated importance sampling weighs each token by min(p_trainer / "
                  f"p_engine, rl.importance_cap={cap:g})" if cap is not None else
                  "rl.importance_cap=null: not corrected")
    return (f"the engine's log-probabilities differ from the trainer's by up to {gap:.1e} "
            f"({jax.default_backend()} kernels): {correction}")

  def _overlong(self, samples: list[Sample]) -> np.ndarray:
    """DAPO's soft overlong penalty of each sample (0 without `rl.overlong_buffer`): 0 up to
    `max_completion_tokens - buffer` tokens, then falling linearly to -1 (times
    `rl.overlong_penalty`) at `max_completion_tokens`."""
    buffer = self.rl.overlong_buffer
    if not buffer:
      return np.zeros(len(samples), np.float32)
    free = self.rl.max_completion_tokens - buffer
    over = np.asarray([max(len(s.tokens) - free, 0) for s in samples], np.float32)
    return -np.float32(self.rl.overlong_penalty) * np.minimum(over / buffer, 1.0)

  def evaluate(self, model: nnx.Module, batches: Iterable[dict[str, np.ndarray]],
               max_batches: int) -> dict[str, float]:
    """Rewards on the held-out prompts of the first `max_batches` batches (see the module)."""
    greedy, sampled, lengths = [], [], []
    model = sharding.on_this_process(model)
    for number, batch in enumerate(batches):
      if number == max_batches:
        break
      indices = [int(i) for i in batch["prompt_index"]]
      best = self.sample(model, "validation", indices, 1, 0.0, EVAL_STEP)
      greedy.append(self._score("validation", indices, 1, best))
      lengths += [len(s.tokens) for s in best]
      if not self.rewards:  # Nothing to score a sampled group by.
        continue
      group = self.rl.num_generations
      drawn = self.sample(model, "validation", indices, group, self.rl.temperature, EVAL_STEP)
      sampled.append(self._score("validation", indices, group, drawn))
    if not greedy:
      raise DataError("data: the validation split has no full batch of prompts: lower "
                      "data.batch_size or raise data.validation_fraction")
    if not self.rewards:
      return mean_over_processes({"eval_completion_tokens": float(np.mean(lengths))})
    greedy_scores, sampled_scores = np.concatenate(greedy), np.concatenate(sampled)
    return mean_over_processes({"eval_reward": float((greedy_scores @ self.weights).mean()),
            **{f"eval_reward_{r.short_name}": float(greedy_scores[:, i].mean())
               for i, r in enumerate(self.rewards)},
            "eval_sampled_reward": float((sampled_scores @ self.weights).mean()),
            "eval_completion_tokens": float(np.mean(lengths))})

  def sample(self, model: nnx.Module, split: str, indices: list[int], group: int,
             temperature: float, step: int) -> list[Sample]:
    """`group` completions of each prompt of `split` at `indices`, in that order."""
    requests = []
    for index in indices:
      ids, stops = self.encode(self.splits[split].records[index])
      room = self.limit - ids.size
      if room < 1:
        raise DataError(f"data: prompt {index} of the {split} split is {ids.size} tokens and "
                        f"leaves no room for a completion in data.seq_len + 1 = "
                        f"{self.config.data.seq_len + 1}: raise data.seq_len or shorten it")
      for g in range(group):
        seed = int(np.random.SeedSequence(
            [self.config.train.seed, step % 2**32, index, g]).generate_state(1)[0] >> 1)
        requests.append(inference.Request(
            tuple(int(t) for t in ids), min(self.rl.max_completion_tokens, room),
            temperature=temperature, top_k=self.rl.top_k, top_p=self.rl.top_p, seed=seed,
            stop_ids=stops or (self.tokenizer.eos_id,)))
    # Slots as long as a rollout can be (not the model's whole context): one program a run.
    engine = inference.Engine(model, max_slots=min(len(requests), MAX_SLOTS), max_len=self.limit)
    samples = []
    for request, done in zip(requests, engine.run(requests)):
      kept = done.tokens[:-1] if done.finish_reason == "stop" else done.tokens
      text = self.tokenizer.decode(np.asarray(kept, np.int32))
      samples.append(Sample(np.asarray(request.prompt, np.int32), done.tokens, done.logprobs,
                            done.finish_reason, text))
    return samples

  def _score(self, split: str, indices: list[int], group: int, samples: list[Sample]
             ) -> np.ndarray:
    """Each reward of each sample, [N, R] (the samples of each prompt at `indices`, a group
    each)."""
    records = [self.splits[split].records[i] for i in indices for _ in range(group)]
    prompts = [r.get("messages", r.get("prompt")) for r in records]
    names = sorted({k for r in records for k in r} - {"messages", "prompt"})
    columns = {name: [r.get(name) for r in records] for name in names}
    return rewards_lib.score(self.rewards, prompts, [s.text for s in samples], columns)

  def _arrays(self, samples: list[Sample], advantage: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of a rollout batch (see the module)."""
    sequences = [(np.concatenate([s.prompt_ids, np.asarray(s.tokens, np.int32)]),
                  np.repeat(np.float32([0, 1]), [s.prompt_ids.size, len(s.tokens)]))
                 for s in samples]
    longest = max_over_processes(max(len(ids) for ids, _ in sequences) - 1)
    arrays = examples.one_per_row(sequences, pad_id=self.tokenizer.pad_id,
                                  seq_len=row_length(longest, self.config.data.seq_len))
    arrays["sampler_logps"] = np.zeros_like(arrays["loss_mask"])
    for row, sample in enumerate(samples):
      first = sample.prompt_ids.size - 1  # The target of this position is the first new token.
      arrays["sampler_logps"][row, first:first + len(sample.tokens)] = sample.logprobs
    return {**arrays, "advantages": np.asarray(advantage, np.float32),
            "fresh": np.ones(len(samples), np.float32)}


def row_length(longest: int, seq_len: int) -> int:
  """The positions of a rollout batch's rows whose longest sequence has `longest` inputs: the
  next of 16, 24, 32, 48, 64, 96, ... (a power of two or three quarters of one), at most
  `seq_len`. The update costs what the rows hold, not `data.seq_len` (128 rows of 64
  positions against 128 on lm-tiny-grpo: 668 against 1,570 ms a step, benchmarks/rl.py); a
  row is at most a third longer than its sequence (47 tokens of ChatML prompt and a
  32-token reply fill 48, not 64: a quarter of the update saved); two lengths an octave keep
  the train step's programs few (one each, compiled when first met).

  Example:
    >>> row_length(45, 128), row_length(49, 128), row_length(3, 128), row_length(100, 64)
    (48, 64, 16, 64)
  """
  power = inference.programs.padded_length(longest, seq_len * 2)
  three_quarters = power * 3 // 4
  fits = longest <= three_quarters and power > inference.programs.MIN_PADDED
  return min(three_quarters if fits else power, seq_len)


def max_over_processes(value: int) -> int:
  """The largest of each process's `value` (every process's rows have one length)."""
  if jax.process_count() == 1:
    return value
  return int(np.max(multihost_utils.process_allgather(np.asarray(value))))


def mean_over_processes(metrics: dict[str, float]) -> dict[str, float]:
  """Each metric's mean over the processes (each measured the same number of rows); as is
  on one process."""
  if jax.process_count() == 1:
    return metrics
  names = sorted(metrics)
  values = multihost_utils.process_allgather(np.asarray([metrics[n] for n in names]))
  return dict(zip(names, (float(v) for v in np.mean(values, axis=0))))
