"""Our GRPO-family loss equals TRL's GRPOTrainer and Tunix's GRPO on the same inputs (issue #45).

tests/references/grpo/references.json holds fixed log-probabilities, completion
masks and rewards, and what TRL's and Tunix's own code computed from them, case by
case with the library's settings and the matching ones of ours: advantages,
per-token losses, per-token KL to the reference and the aggregated loss. Each is
checked against `grpo.advantages`, `grpo.token_losses` (+ beta `kl_to_reference`),
`grpo.kl_to_reference` and `grpo.aggregate` within 1e-5 (float32). A loss case feeds
the library's own advantages to both sides.

CI does not install torch, trl or tunix: `scripts/make_grpo_references.py`
regenerates the file in a throwaway venv (its docstring says how).

Where our definition differs, the cases assert exactly that difference:
- "grpo" advantages are scaled by the group's sample standard deviation (ddof 1) by
  all three; Tunix 0.1.7 adds 1e-6 to it, TRL 1e-4 as we do;
- TRL's default `use_bias_correction_kl=True` weights the KL by the ratio
  exp(logp - old) (DeepSeek-V3.2); ours does not (nor Tunix, nor TRL with it off):
  the two agree at a rollout's first update (ratio 1), not at the later ones;
- Tunix's sequence-mean aggregations divide by the completions that have a token,
  ours (and TRL's) by all of them: they differ only when a completion has none.
Tunix aggregates its KL apart (beta * aggregate(kl)): its per-token loss has no KL.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack.recipes.tasks import grpo

REFERENCES = json.loads((pathlib.Path(__file__).parent / "references" / "grpo"
                         / "references.json").read_text(encoding="utf-8"))
INPUTS = {name: np.asarray(values, np.float32) for name, values in REFERENCES["inputs"].items()}
ADVANTAGES = {case["name"]: case for case in REFERENCES["advantages"]}
LOSSES = {case["name"]: case for case in REFERENCES["losses"]}
WITH_KL = sorted(name for name, case in LOSSES.items() if case["kl"] is not None)


def assert_close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=0, atol=1e-5)


def group_std(ddof: int) -> np.ndarray:
  """Each row's group standard deviation [P * G]."""
  rewards = INPUTS["rewards"]
  return np.repeat(rewards.std(axis=1, ddof=ddof), rewards.shape[1])


def kl_times_ratio(case) -> bool:
  """Whether the library weighted the KL by the ratio (TRL's use_bias_correction_kl)."""
  return bool(case["kl"] is not None and case["settings"].get("use_bias_correction_kl"))


def our_kl(case) -> jnp.ndarray:
  """Our k3 per token, times the ratio where the library applies it (we do not)."""
  logps = jnp.asarray(INPUTS["logps"])
  kl = grpo.kl_to_reference(logps, jnp.asarray(INPUTS["ref_logps"]))
  if kl_times_ratio(case):
    kl = kl * jnp.exp(logps - jnp.asarray(INPUTS["old_logps"]))
  return kl


def our_token_losses(case, with_kl: bool = True) -> jnp.ndarray:
  """Ours per token, as `GroupRelative.loss` adds them, on the case's advantages."""
  ours = case["ours"]
  losses, _ = grpo.token_losses(jnp.asarray(INPUTS["logps"]), jnp.asarray(INPUTS["old_logps"]),
                                jnp.asarray(case["advantages"], jnp.float32),
                                epsilon=ours["epsilon"], epsilon_high=ours["epsilon_high"])
  if with_kl and ours["beta"] > 0:
    losses = losses + ours["beta"] * our_kl(case)
  return losses


def test_every_variant_and_aggregation_has_both_libraries():
  """A regenerated file that drops a case would otherwise pass unnoticed."""
  variants = {(case["library"], case["ours"]) for case in ADVANTAGES.values()}
  aggregations = {(case["library"], case["ours"]["aggregation"], case["mask"])
                  for case in LOSSES.values()}
  for library in ("trl", "tunix"):
    assert {(library, kind) for kind in ("grpo", "dr_grpo", "rloo")} <= variants
    assert {(library, kind, "mask") for kind in ("sequence", "token", "constant")} <= aggregations
    assert {(library, kind, "mask_empty_row") for kind in ("sequence", "constant")} <= aggregations
  plain_kl = {(case["library"], case["ours"]["aggregation"]) for name, case in LOSSES.items()
              if name in WITH_KL and not kl_times_ratio(case)}
  assert {agg for _, agg in plain_kl} == {"sequence", "token", "constant"}
  assert {library for library, _ in plain_kl} == {"trl", "tunix"}
  assert (INPUTS["mask_empty_row"].sum(axis=1) == 0).sum() == 1


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages(name):
  """The library's own, where its guard on the standard deviation is ours (TRL's 1e-4);
  Tunix's 1e-6 guard undone and ours applied otherwise."""
  case = ADVANTAGES[name]
  ours = grpo.advantages(INPUTS["rewards"], case["ours"]).reshape(-1)
  theirs = np.asarray(case["advantages"], np.float32)
  settings = case["settings"]
  if case["ours"] != "grpo" or settings["std_epsilon"] == grpo.STD_EPSILON:
    assert_close(ours, theirs)
    return
  assert settings["std_ddof"] == 1  # the library's, found from its output by the script
  centred = theirs * (group_std(1) + settings["std_epsilon"])
  assert_close(ours, centred / (group_std(1) + grpo.STD_EPSILON))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_token_losses(name):
  """The clipped surrogate (+ beta k3 where the library adds it per token) at every
  position, padding included."""
  case = LOSSES[name]
  assert_close(our_token_losses(case, with_kl=case["token_losses_include_kl"]),
               case["token_losses"])


@pytest.mark.parametrize("name", WITH_KL)
def test_kl_to_reference(name):
  """Both libraries' penalty is the same k3 estimate, exp(ref - logp) - (ref - logp) - 1."""
  case = LOSSES[name]
  assert_close(our_kl(case), case["kl"])
  if kl_times_ratio(case):  # a real difference here: these tokens are off-policy
    plain = grpo.kl_to_reference(jnp.asarray(INPUTS["logps"]), jnp.asarray(INPUTS["ref_logps"]))
    assert not np.allclose(plain, case["kl"], atol=1e-3)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_aggregated_loss(name):
  """grpo/sequence-mean-token-mean: sequence; bnpo, dapo, token-mean: token; dr_grpo and
  sequence-mean-token-scale: constant (TRL's max_completion_length, Tunix's width T)."""
  case = LOSSES[name]
  mask = INPUTS[case["mask"]]
  loss = grpo.aggregate(our_token_losses(case), jnp.asarray(mask), case["ours"]["aggregation"],
                        case["ours"]["max_tokens"])
  if case["library"] == "tunix" and case["ours"]["aggregation"] in ("sequence", "constant"):
    # Tunix averages over the completions that have a token; we average over all.
    rows, nonempty = mask.shape[0], int((mask.sum(axis=1) > 0).sum())
    if nonempty < rows:
      assert not np.isclose(float(loss), case["loss"], rtol=0, atol=1e-5)
    loss = loss * rows / nonempty
  assert_close(loss, case["loss"])
