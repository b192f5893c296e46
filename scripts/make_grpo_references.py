"""Writes TRL's and Tunix's GRPO numbers that tests/test_grpo_references.py compares with.

Fixed inputs from a seeded NumPy RNG (3 prompts x 4 completions, 7 completion
tokens with right padding, per-token log-probabilities of the policy, of the
sampling policy (small noise: some ratios leave [0.8, 1.28]) and of the
reference, rewards with one group all equal, and a second mask in which one
completion has no token left) go through each library's own code:

  TRL   `GRPOTrainer._generate_and_score_completions` (advantages, the completion
        mask, the token count) and `GRPOTrainer._compute_loss` (the loss), on a
        real trainer over a tiny random model saved to a temporary folder. Its
        `_generate` is replaced by one that returns the fixed completions,
        `_get_per_token_logps_and_entropies` by one that returns the fixed
        log-probabilities (the sampling policy's when TRL scores the rollout,
        with num_iterations=2 so that it does; the policy's in the loss; the
        reference's for the reference model), and the rewards come from a
        reward function that returns each row's fixed reward. The per-token loss
        and KL are `_compute_loss`'s own locals (`per_token_loss`, `per_token_kl`)
        as it returns (sys.setprofile). The empty completion is one that TRL
        drops itself: it never ends, and `mask_truncated_completions=True`.
        `RLOOTrainer` gives the leave-one-out advantages the same way.
  Tunix the registered advantage estimators ("grpo", "drgrpo", "rloo") and the
        registered "grpo" policy loss (`tunix.rl.algo_core.grpo_loss_fn`) with
        `GRPOConfig`, `DAPOConfig` and `DrGRPOConfig`; `common.compute_per_token_logps`
        is replaced by one that returns the fixed log-probabilities, and the
        per-token loss and KL are the loss function's locals (`per_token_loss`,
        `kl`) as it returns. Tunix aggregates the KL apart and adds
        beta * aggregate(kl) to the loss, so its per-token loss has no KL.

into tests/references/grpo/references.json: the inputs, each case's settings,
the library's advantages, per-token loss, per-token KL and loss, and the
versions. What the libraries do, as found (the test holds it):
- both scale "grpo" advantages by the group's unbiased standard deviation
  (ddof 1, as ours), TRL with + 1e-4 as ours, Tunix with + 1e-6
  (`std_ddof` and `std_epsilon` below are found from the outputs);
- TRL's default `use_bias_correction_kl=True` multiplies the k3 KL by the ratio;
- Tunix's default `kl_loss_mode` is "kl" (logp - ref): "low_var_kl" is the k3;
- Tunix's "sequence-mean-token-mean" and "sequence-mean-token-scale" average
  over the completions that have a token, ours and TRL's over all of them;
  "sequence-mean-token-scale" divides by the padded width T;
- TRL's "dapo" divides by `num_items_in_batch` (the generation batch's completion
  tokens) / processes x accumulation steps / steps_per_generation: one process and
  one step here, so the batch's token count, as "bnpo" and ours ("token");
- Tunix's `DAPOConfig` refuses a beta: its clip-higher cases have no KL;
- Tunix clips the log-ratio to [-20, 20] before exp (ours does not; no ratio here
  comes near it).

Needs torch, trl, transformers and google-tunix (with jax), which CI does not
install: CI compares against the committed file. Run it again in a throwaway venv:

  python3 -m venv /tmp/refvenv
  /tmp/refvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
      (or PyPI's torch==2.13.0: only its CPU code runs)
  /tmp/refvenv/bin/pip install trl==1.16.0 transformers==4.57.1 google-tunix==0.1.7
  /tmp/refvenv/bin/python scripts/make_grpo_references.py

Written with trl 1.16.0, transformers 4.57.1, torch
2.13.0 (CPU), google-tunix 0.1.7, jax 0.10.2 and flax 0.12.8, on Python 3.11.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import json
import pathlib
import sys
import tempfile

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "references" / "grpo"
PROMPTS, GENERATIONS, T = 3, 4, 7
N = PROMPTS * GENERATIONS
EPSILON, EPSILON_HIGH, BETA = 0.2, 0.28, 0.04
EMPTY_ROW = 5
"""The completion that has no token in the mask "mask_empty_row"."""


def inputs() -> dict[str, np.ndarray]:
  """The fixed batch: the masks (one row fills T), log-probabilities and rewards."""
  rng = np.random.default_rng(45)
  lengths = rng.integers(1, T + 1, N)
  lengths[0] = T
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  empty = mask.copy()
  empty[EMPTY_ROW] = 0.0
  logps = -rng.uniform(0.05, 3.0, (N, T)).astype(np.float32)
  old = (logps + rng.normal(0.0, 0.2, (N, T))).astype(np.float32)
  ref = (logps + rng.normal(0.0, 0.3, (N, T))).astype(np.float32)
  rewards = np.stack([rng.uniform(0.0, 2.0, GENERATIONS),  # all different
                      np.array([1.0, 0.0, 0.0, 1.0]),  # right or wrong
                      np.full(GENERATIONS, 0.5)]).astype(np.float32)  # all equal: std 0
  ratio = np.exp(logps - old)[mask > 0]
  assert ((ratio < 1 - EPSILON) | (ratio > 1 + EPSILON_HIGH)).any(), "no ratio is clipped"
  return {"rewards": rewards, "mask": mask, "mask_empty_row": empty, "logps": logps,
          "old_logps": old, "ref_logps": ref}


def short(values) -> object:
  """Float32 values as the shortest decimals that read back as the same float32."""
  array = np.asarray(values, np.float32)
  return np.vectorize(lambda x: float(str(np.float32(x))), otypes=[object])(array).tolist()


def std_scaling(rewards: np.ndarray, advantages: np.ndarray) -> dict[str, float]:
  """The standard deviation (ddof) and guard (epsilon) that reproduce scaled advantages."""
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  for ddof in (0, 1):
    for epsilon in (1e-4, 1e-6):
      expected = centred / (rewards.std(axis=1, ddof=ddof, keepdims=True) + epsilon)
      if np.allclose(expected.reshape(-1), advantages, rtol=1e-6, atol=1e-7):
        return {"std_ddof": ddof, "std_epsilon": epsilon}
  raise AssertionError(f"no std scaling reproduces {advantages}")


@contextlib.contextmanager
def locals_at_return(function):
  """Yields a dict that holds `function`'s local variables once it has returned."""
  code, seen, previous = inspect.unwrap(function).__code__, {}, sys.getprofile()

  def profile(frame, event, arg):
    if event == "return" and frame.f_code is code:
      seen.update(frame.f_locals)

  sys.setprofile(profile)
  try:
    yield seen
  finally:
    sys.setprofile(previous)


# TRL

TRL_LOSSES = [  # loss_type, scale_rewards, beta, epsilon_high, max_completion_length,
    # use_bias_correction_kl (TRL's default True weights the KL by the ratio; ours does not),
    # the mask, ours
    ("grpo", "group", BETA, EPSILON_HIGH, T, False, "mask", "sequence"),
    ("grpo", "group", BETA, EPSILON_HIGH, T, True, "mask", "sequence"),
    ("grpo", "group", 0.0, EPSILON, T, True, "mask", "sequence"),
    ("grpo", "group", BETA, EPSILON_HIGH, T, False, "mask_empty_row", "sequence"),
    ("bnpo", "group", BETA, EPSILON_HIGH, T, False, "mask", "token"),
    ("dapo", "group", 0.0, EPSILON_HIGH, T, True, "mask", "token"),
    ("dapo", "group", BETA, EPSILON_HIGH, T, False, "mask", "token"),
    ("dr_grpo", "none", BETA, EPSILON_HIGH, T, False, "mask", "constant"),
    ("dr_grpo", "none", 0.0, EPSILON, 10, True, "mask", "constant"),  # the configured length
    ("dr_grpo", "none", BETA, EPSILON_HIGH, T, False, "mask_empty_row", "constant"),
]


class _Fixed:
  """Stands in for the models' forward passes: the fixed log-probabilities of each."""

  def __init__(self, trainer, data):
    import torch
    self.trainer, self.phase = trainer, "score"
    self.tensors = {k: torch.tensor(data[k]) for k in ("logps", "old_logps", "ref_logps")}

  def __call__(self, model, input_ids, attention_mask, logits_to_keep, *_, **__):
    assert input_ids.shape[0] == N and logits_to_keep == T, (input_ids.shape, logits_to_keep)
    if model is self.trainer.ref_model:
      logps = self.tensors["ref_logps"]
    elif self.phase == "score":  # the rollout's scoring: the sampling policy
      logps = self.tensors["old_logps"]
    else:
      logps = self.tensors["logps"]
    return logps.clone(), logps.new_zeros(logps.shape), None


def _tiny_model(folder: pathlib.Path):
  """A random two-layer Llama and a word-level tokenizer, saved where TRL can load the reference."""
  import tokenizers
  import transformers
  vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)])}
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
      pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
  config = transformers.DecoderConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                    bos_token_id=1)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  tokenizer.save_pretrained(folder)
  return tokenizer


def _rollout(trainer, mask: np.ndarray):
  """The fixed completions in `_generate`'s form: each row as long as its mask, ending in
  EOS; a row with no token never ends (T tokens), for mask_truncated_completions."""
  prompt_ids = [[3 + p, 4 + p, 5] for p in range(PROMPTS) for _ in range(GENERATIONS)]
  completion_ids = [[3 + (i + t) % 29 for t in range(n - 1)] + [1] if n else
                    [3 + (i + t) % 29 for t in range(T)]
                    for i, n in enumerate(mask.sum(axis=1).astype(int))]
  completions = [trainer.processing_class.decode(ids) for ids in completion_ids]

  def generate(prompts):
    assert len(prompts) == N
    if type(trainer).__name__ == "RLOOTrainer":  # its `_generate` returns three lists
      return prompt_ids, completion_ids, completions
    return prompt_ids, completion_ids, None, completions, None, {}, None, None

  return generate


def _trainer(cls, config_cls, folder, tokenizer, data, mask="mask", **settings):
  import datasets
  rewards = data["rewards"].reshape(-1).tolist()

  def fixed_reward(completions, row, **_):
    """Each row's reward from the fixed table (the batch's `row` column)."""
    return [rewards[i] for i in row]

  settings = {"max_completion_length": T, **settings}
  args = config_cls(output_dir=str(folder / "out"), report_to="none", use_cpu=True,
                    per_device_train_batch_size=N, num_generations=GENERATIONS,
                    logging_steps=1, save_strategy="no",
                    mask_truncated_completions=mask != "mask", **settings)
  prompts = datasets.Dataset.from_dict({"prompt": [f"w{p}" for p in range(PROMPTS)]})
  trainer = cls(model=str(folder), reward_funcs=fixed_reward, args=args, train_dataset=prompts,
                processing_class=tokenizer)
  trainer._generate = _rollout(trainer, data[mask])
  fixed = _Fixed(trainer, data)
  trainer._get_per_token_logps_and_entropies = fixed
  trainer.model.train()
  batch = [{"prompt": f"w{i // GENERATIONS}", "row": i} for i in range(N)]
  return trainer, fixed, batch


def trl_references(data) -> tuple[list[dict], list[dict]]:
  import trl
  from trl.trainer.grpo_trainer import GRPOTrainer

  advantages, losses = [], []
  with tempfile.TemporaryDirectory() as tmp:
    folder = pathlib.Path(tmp)
    tokenizer = _tiny_model(folder)
    for scale_rewards, ours in (("group", "grpo"), ("none", "dr_grpo")):
      trainer, _, batch = _trainer(GRPOTrainer, trl.GRPOConfig, folder, tokenizer, data,
                                   scale_rewards=scale_rewards)
      values = trainer._generate_and_score_completions(batch)["advantages"].numpy()
      settings = {"trainer": "GRPOTrainer", "scale_rewards": scale_rewards}
      if scale_rewards == "group":
        settings.update(std_scaling(data["rewards"], values))
      advantages.append({"name": f"trl-grpo-scale_rewards={scale_rewards}", "library": "trl",
                         "ours": ours, "settings": settings, "advantages": short(values)})
    trainer, _, batch = _trainer(trl.RLOOTrainer, trl.RLOOConfig, folder, tokenizer, data,
                                 beta=0.0, normalize_advantages=False)
    values = trainer._generate_and_score_completions(batch)["advantages"].numpy()
    advantages.append({"name": "trl-rloo", "library": "trl", "ours": "rloo",
                       "settings": {"trainer": "RLOOTrainer", "beta": 0.0,
                                    "normalize_advantages": False},
                       "advantages": short(values)})

    for loss_type, scale_rewards, beta, epsilon_high, max_length, bias_kl, mask, ours in TRL_LOSSES:
      trainer, fixed, batch = _trainer(
          GRPOTrainer, trl.GRPOConfig, folder, tokenizer, data, mask=mask, loss_type=loss_type,
          scale_rewards=scale_rewards, beta=beta, epsilon=EPSILON, epsilon_high=epsilon_high,
          num_iterations=2, max_completion_length=max_length, use_bias_correction_kl=bias_kl)
      out = trainer._generate_and_score_completions(batch)
      assert np.array_equal(out["completion_mask"].numpy(), data[mask]), "another mask"
      assert "old_per_token_logps" in out and (beta == 0) == ("ref_per_token_logps" not in out)
      fixed.phase = "loss"
      trainer.current_gradient_accumulation_steps = 1  # as the loop sets it: no accumulation
      with locals_at_return(GRPOTrainer._compute_loss) as seen:
        loss = trainer._compute_loss(trainer.model, out)
      settings = {"trainer": "GRPOTrainer", "loss_type": loss_type,
                  "scale_rewards": scale_rewards, "beta": beta, "epsilon": EPSILON,
                  "epsilon_high": epsilon_high, "max_completion_length": max_length,
                  "use_bias_correction_kl": bias_kl, "num_iterations": 2,
                  "mask_truncated_completions": mask != "mask",
                  "num_items_in_batch": int(out["num_items_in_batch"].item())}
      name = f"trl-{loss_type}-beta={beta}-eps_high={epsilon_high}-max={max_length}"
      name += ("-kl_x_ratio" if beta and bias_kl else "") + ("-empty_row" if mask != "mask" else "")
      losses.append({
          "name": name, "library": "trl", "settings": settings, "mask": mask,
          "ours": {"aggregation": ours, "epsilon": EPSILON, "epsilon_high": epsilon_high,
                   "beta": beta, "max_tokens": max_length},
          "advantages": short(out["advantages"].numpy()),
          "token_losses": short(seen["per_token_loss"].detach().numpy()),
          "token_losses_include_kl": bool(beta),
          "kl": short(seen["per_token_kl"].detach().numpy()) if beta else None,
          "loss": short(loss.detach().numpy())})
  return advantages, losses


# Tunix

def tunix_references(data) -> tuple[list[dict], list[dict]]:
  from flax import nnx
  import jax.numpy as jnp
  from tunix.rl import common, function_registry
  from tunix.rl.grpo import dapo_learner, drgrpo_learner, grpo_learner

  rewards = data["rewards"].reshape(-1)
  found, advantages = {}, []
  for estimator, ours in (("grpo", "grpo"), ("drgrpo", "dr_grpo"), ("rloo", "rloo")):
    values = np.asarray(function_registry.get_advantage_estimator(estimator)(
        rewards=rewards, num_generations=GENERATIONS), np.float32)
    found[estimator] = values
    settings = {"advantage_estimator": estimator}
    if estimator == "grpo":
      settings.update(std_scaling(data["rewards"], values))
    advantages.append({"name": f"tunix-{estimator}", "library": "tunix", "ours": ours,
                       "settings": settings, "advantages": short(values)})

  low_var = {"kl_loss_mode": "low_var_kl"}  # the k3; Tunix's default "kl" is logp - ref
  configs = [  # config, its advantages, the mask, ours (the aggregation)
      (grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON, **low_var),
       "grpo", "mask", "sequence"),
      (grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=0.0, epsilon=EPSILON),
       "grpo", "mask", "sequence"),
      (grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON,
                               loss_agg_mode="token-mean", **low_var), "grpo", "mask", "token"),
      (dapo_learner.DAPOConfig(num_generations=GENERATIONS, epsilon=EPSILON,
                               epsilon_high=EPSILON_HIGH, overlong_buffer=None),
       "grpo", "mask", "token"),
      (drgrpo_learner.DrGRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON,
                                   **low_var), "drgrpo", "mask", "constant"),
      (grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON, **low_var),
       "grpo", "mask_empty_row", "sequence"),
      (grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON,
                               loss_agg_mode="token-mean", **low_var),
       "grpo", "mask_empty_row", "token"),
      (drgrpo_learner.DrGRPOConfig(num_generations=GENERATIONS, beta=BETA, epsilon=EPSILON,
                                   **low_var), "drgrpo", "mask_empty_row", "constant"),
  ]
  model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))  # never called: the log-probabilities are fixed

  def fixed_logps(*_, return_logits=False, **__):
    logps = jnp.asarray(data["logps"])
    return (logps, jnp.zeros((N, T, 8), jnp.float32)) if return_logits else logps

  common.compute_per_token_logps = fixed_logps
  loss_fn = function_registry.get_policy_loss_fn("grpo")
  losses = []
  for config, estimator, mask, ours in configs:
    config.temperature = 1.0  # as GRPOLearner sets it from the rollout's
    beta = config.beta or 0.0
    example = common.TrainExample(
        prompt_ids=jnp.full((N, 3), 5, jnp.int32), prompt_mask=jnp.ones((N, 3), jnp.int32),
        completion_ids=jnp.full((N, T), 5, jnp.int32), completion_mask=jnp.asarray(data[mask]),
        advantages=jnp.asarray(found[estimator]),
        ref_per_token_logps=jnp.asarray(data["ref_logps"]) if beta else None,  # as the learner
        old_per_token_logps=jnp.asarray(data["old_logps"]))
    with locals_at_return(loss_fn) as seen:
      loss, _ = loss_fn(model, example, config, pad_id=0, eos_id=1)
    epsilon_high = getattr(config, "epsilon_high", config.epsilon)
    settings = {"config": type(config).__name__, "policy_loss_fn": config.policy_loss_fn,
                "advantage_estimator": estimator, "loss_agg_mode": config.loss_agg_mode,
                "beta": config.beta, "kl_loss_mode": config.kl_loss_mode,
                "epsilon": config.epsilon, "epsilon_high": epsilon_high}
    name = f"tunix-{type(config).__name__}-{config.loss_agg_mode}-beta={beta}"
    losses.append({
        "name": name + ("-empty_row" if mask != "mask" else ""),
        "library": "tunix", "settings": settings, "mask": mask,
        "ours": {"aggregation": ours, "epsilon": config.epsilon, "epsilon_high": epsilon_high,
                 "beta": beta, "max_tokens": T},  # token-scale divides by the width T
        "advantages": short(found[estimator]),
        "token_losses": short(seen["per_token_loss"]),
        "token_losses_include_kl": False,  # Tunix adds beta * aggregate(kl) to the loss
        "kl": short(seen["kl"]) if beta else None,
        "loss": short(loss)})
  return advantages, losses


def main() -> None:
  data = inputs()
  versions = {name: importlib.metadata.version(name) for name in
              ("trl", "transformers", "torch", "google-tunix", "jax", "flax", "numpy")}
  trl_advantages, trl_losses = trl_references(data)
  tunix_advantages, tunix_losses = tunix_references(data)
  references = {
      "versions": versions,
      "shape": {"prompts": PROMPTS, "generations": GENERATIONS, "completion_tokens": T},
      "inputs": {name: short(values) for name, values in data.items()},
      "advantages": trl_advantages + tunix_advantages,
      "losses": trl_losses + tunix_losses,
  }
  OUT.mkdir(parents=True, exist_ok=True)
  path = OUT / "references.json"
  path.write_text(json.dumps(references, separators=(",", ":")) + "\n", encoding="utf-8")
  print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  main()
