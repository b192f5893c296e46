"""A run SIGKILLed mid-training and resumed is the run that never stopped, bitwise: one
matrix over (objective, transform, family, data, mesh), each case with the same assertions.

Each case trains its whole run, kills another in a `jax-ai-stack train` subprocess once it
has logged a step (checkpoints saved every step or few, so a save is often in flight), resumes
it, and compares every train and eval record (less wall-clock fields), every array of the final
state (parameters, optimizer moments, RNG) and the checkpoint folder's leftovers. What a case
adds about its own objective (DPO's start at the base, GRPO's sampler gap, a MoE's router
metrics) is checked on the same whole run, so no case trains twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Callable

import numpy as np
import pytest

from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from multidevice import run_on_devices
from test_evaluation_harness import write_tasks
from test_families import PRESET_SIZE
from training_helpers import TINY, checkpoint_paths, finish_both, kill_at_step, records

pytestmark = pytest.mark.slow  # Each case trains three times (its kill in a subprocess).

MODEL = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=64"]
RUN = [*MODEL, "train.progress=false", "train.sample_tokens=0", "optim.warmup_steps=1"]
TUNE = [*RUN, "model.max_seq_len=32", "data.seq_len=32", "data.batch_size=4",
        "data.validation_fraction=0.3", "train.eval_batches=1", "train.steps=8",
        "train.eval_every=4", "checkpoint.save_every=1"]
"""Chat SFT and DPO from a base: 8 steps, killed after the 3rd."""
RL = [*RUN, "data.max_documents=200", "data.validation_fraction=0.1", "data.batch_size=2",
      "rl.num_generations=4", "rl.max_completion_tokens=6", "train.eval_every=3",
      "train.eval_batches=1", "train.log_every=1", "optim.learning_rate=0.01", "train.steps=6",
      "rl.rewards=[test_rl_rewards:distinct_characters]", "rl.reward_weights=null"]
"""GRPO from a base, with a reward an untrained model's completions differ in."""
MOE = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2",
       "model.mlp_dim=32", "model.max_seq_len=32", "model.moe.num_experts=4", "data.seq_len=32",
       "data.batch_size=4", "data.max_documents=30", "data.validation_fraction=0.2",
       "train.eval_batches=1", "train.progress=false", "train.sample_tokens=0",
       "optim.warmup_steps=1", "train.steps=8", "train.eval_every=4", "checkpoint.save_every=1"]
"""A kv head per tensor device on the mesh."""
EXPERT_PARALLEL = ["mesh.rules=fsdp_tp", "mesh.data=1", "mesh.expert=4", "mesh.tensor=2"]
MIXTURE = ("data.mixture={components: {logs: {paths: ['logging/*']}, js: {paths: ['json/*']}}, "
           "stages: [{step: 0, weights: {logs: 3, js: 1}}, {step: 6, weights: {js: 1}}]}")


class Inputs:
  """What the cases read, made once per module: bases to fine-tune and small data files."""

  def __init__(self, folder: pathlib.Path):
    self.folder = folder
    self.bases: dict[tuple[str, ...], pathlib.Path] = {}

  def base(self, *overrides: str) -> pathlib.Path:
    """A 2-step lm-tiny run of `overrides`' model, made on first use."""
    if overrides not in self.bases:
      workdir = self.folder / f"base-{len(self.bases)}"
      train.run(config_lib.load("lm-tiny", overrides=[
          *overrides, "data.max_documents=30", "train.steps=2", "train.eval_every=0"]), workdir)
      self.bases[overrides] = workdir
    return self.bases[overrides]

  def jsonl(self, name: str, rows: list[dict]) -> pathlib.Path:
    path = self.folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path

  def sums(self) -> pathlib.Path:
    return self.jsonl("sums.jsonl", [{"prompt": f"{i} + 1", "completion": f"{i + 1}"}
                                     for i in range(60)])

  def pairs(self) -> pathlib.Path:
    return self.jsonl("pairs.jsonl", [{"prompt": f"{i}", "chosen": "yes", "rejected": "no"}
                                      for i in range(60)])

  def tasks(self) -> pathlib.Path:
    return write_tasks(self.folder / "tasks")


@dataclasses.dataclass(frozen=True)
class Case:
  objective: str
  transform: str
  family: str
  data: str
  preset: str
  overrides: Callable[[Inputs], list[str]]
  kills: tuple[int, ...] = (3,)
  """The steps after which a run is killed (several: killed again after each resume)."""
  devices: int = 1
  check: Callable[[pathlib.Path, str], None] | None = None
  """What the case adds, asked of the whole run's workdir and what it printed."""

  @property
  def id(self) -> str:
    mesh = "1 device" if self.devices == 1 else f"{self.devices} devices"
    return "-".join((self.objective, self.transform, self.family, self.data, mesh))


def _dpo_checks(tuning: str):
  def check(whole: pathlib.Path, out: str) -> None:
    evals = records(whole, "eval")
    assert evals[0]["step"] == 0 and evals[0]["eval_loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert evals[0]["eval_reward_margin"] == 0  # Step 0: the policy is the reference.
    assert evals[-1]["eval_preference_accuracy"] == 1.0 and evals[-1]["eval_loss"] < np.log(2)
    saved = checkpoint_paths(whole)
    assert saved and not [p for p in saved if "reference" in p]  # The copy is never saved.
    if tuning == "full":  # Read again from the base on resume, which no checkpoint holds.
      assert "and a frozen copy of the base's, DPO's reference" in out
  return check


def _grpo_checks(updates: int):
  """With several updates per rollout, saves fall on rollout boundaries and the updates
  after the first compare with the sampling policy (the clip can act)."""
  def check(whole: pathlib.Path, out: str) -> None:
    steps = records(whole, "train")
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert [r["step"] for r in records(whole, "eval")] == [0, 3, 6]  # The base first.
    assert all(r["sampler_logp_gap"] < 1e-5 for r in steps)  # The engine's = the trainer's.
    assert any(r["grad_norm"] > 0 for r in steps)
    fresh = [r for r in steps if (r["step"] - 1) % updates == 0]  # The first on a rollout.
    assert all(r["clip_fraction"] == 0.0 for r in fresh)  # Ratio exactly 1.
    assert all("reward" in r for r in fresh) and len(fresh) == 6 // updates
    if updates > 1:
      assert any(r["clip_fraction"] > 0 for r in steps)
  return check


def _router_checks(whole: pathlib.Path, out: str) -> None:
  assert "grouped matmul: blocked (auto on cpu: " in out
  losses = [r["loss"] for r in records(whole, "train")]
  assert len(losses) == 8 and losses[-1] < losses[0]
  last = records(whole, "eval")[-1]
  assert {"eval_router_aux_loss", "eval_router_z_loss", "eval_lm_loss",
          "eval_expert_share_0"} <= last.keys()
  assert last["eval_perplexity"] == pytest.approx(np.exp(last["eval_lm_loss"]))


def _like_one_device(whole: pathlib.Path, out: str) -> None:
  """Experts over `expert` and MLPs over `tensor` train like one device; not bitwise, since
  a sharded matmul sums in another order."""
  one = whole.parent / "one device"
  train.run(config_lib.load("moe-tiny", overrides=MOE), one)
  np.testing.assert_allclose([r["loss"] for r in records(whole, "train")],
                             [r["loss"] for r in records(one, "train")], rtol=2e-5)


def _distill_checks(whole: pathlib.Path, out: str) -> None:
  assert "(and a frozen teacher of " in out
  saved = checkpoint_paths(whole)
  assert saved and not [p for p in saved if "teacher" in p]  # Read again on resume instead.
  assert all(r["divergence"] > 0 and r["lm_loss"] > 0 for r in records(whole, "train"))


def _harness_checks(whole: pathlib.Path, out: str) -> None:
  evals = records(whole, "eval")
  assert [r["step"] for r in evals] == [4, 8]
  assert all(0 <= r["eval_harness_tiny_sums_acc"] <= 1 for r in evals)


def _phase_checks(whole: pathlib.Path, out: str) -> None:
  steps = records(whole, "train")
  assert len(steps) == 12 and steps[-1]["tokens_js"] > steps[5]["tokens_js"]


def _lora(i: Inputs) -> list[str]:
  return [*TINY, "train.steps=30", f"finetune.base={i.base(*TINY)}", "finetune.lora.rank=4",
          "optim.learning_rate=1e-2", "optim.weight_decay=0", "data.paths=[json/*]",
          "checkpoint.save_every=1"]


def _chat(i: Inputs) -> list[str]:
  return [*PRESET_SIZE, "data.source=chat", f"data.paths=[{i.sums()}]", "data.max_documents=null",
          "train.steps=8", "train.eval_every=4", "train.sample_tokens=0", "checkpoint.save_every=1"]


def _dpo(tuning: str) -> Callable[[Inputs], list[str]]:
  return lambda i: [*TUNE, "data.source=preference", f"data.paths=[{i.pairs()}]",
                    f"finetune.base={i.base(*TUNE)}",
                    "finetune.lora={rank: 4}" if tuning == "lora" else "finetune.lora=null",
                    "optim.learning_rate=0.01" if tuning == "lora" else "optim.learning_rate=0.002"]


def _grpo(updates: int, *mesh: str) -> Callable[[Inputs], list[str]]:
  """On a mesh, rollouts and updates with the weights split over `tensor` (a kv head each)."""
  model = ["model.num_kv_heads=2"] if mesh else []
  return lambda i: [*RL, *model, f"finetune.base={i.base(*RUN, *model)}",
                    f"rl.updates_per_rollout={updates}", f"checkpoint.save_every={updates}",
                    *mesh]


CASES = [
    Case("next-token", "none", "llama", "text", "lm-tiny",
         lambda i: [*TINY, "train.steps=30", "checkpoint.save_every=1"], kills=(12,)),
    Case("next-token", "none", "llama", "harness tasks", "lm-tiny",
         lambda i: [*TINY, "train.steps=8", "train.eval_every=4", "checkpoint.save_every=2",
                    f"train.eval_tasks=[{i.tasks()}]", "train.eval_tasks_limit=3"],
         kills=(5,), check=_harness_checks),
    Case("next-token", "none", "llama", "mixture and batch schedule in phases", "lm-tiny",
         lambda i: [*TINY, "train.steps=12", "train.eval_every=6", "checkpoint.save_every=3",
                    "train.sample_tokens=0", MIXTURE,
                    "data.batch_schedule=[{step: 6, batch_size: 8}]"],
         kills=(2, 7), check=_phase_checks),
    Case("next-token", "lora", "llama", "text", "lm-tiny", _lora, kills=(12,)),
    Case("next-token", "qat w8a8", "llama", "text", "lm-tiny",
         lambda i: [*TINY, "train.steps=30", "quant.qat=w8a8", "train.sample_tokens=0",
                    "checkpoint.save_every=1"], kills=(8,)),
    Case("next-token", "none", "moe", "text", "moe-tiny", lambda i: MOE, check=_router_checks),
    Case("next-token", "none", "moe", "text", "moe-tiny", lambda i: [*MOE, *EXPERT_PARALLEL],
         devices=8, check=_like_one_device),
    Case("chat", "none", "qwen3", "chats", "qwen3-tiny", _chat),
    Case("chat", "none", "gemma3", "chats", "gemma3-tiny", _chat),
    Case("chat", "full", "llama", "chats", "lm-tiny-sft",
         lambda i: [*TUNE, "data.source=chat", f"data.paths=[{i.sums()}]",
                    "data.max_documents=null", f"finetune.base={i.base(*TUNE)}",
                    "optim.learning_rate=0.002"]),
    Case("dpo", "lora", "llama", "pairs", "lm-tiny-dpo", _dpo("lora"), check=_dpo_checks("lora")),
    Case("dpo", "full", "llama", "pairs", "lm-tiny-dpo", _dpo("full"), check=_dpo_checks("full")),
    Case("distill", "none", "llama", "text", "lm-tiny-distill",
         lambda i: [*TUNE, "data.max_documents=30", "model.d_model=16",
                    f"finetune.distill.teacher={i.base(*TUNE)}"], check=_distill_checks),
    Case("grpo", "full", "llama", "prompts", "lm-tiny-grpo", _grpo(1), kills=(2,),
         check=_grpo_checks(1)),
    Case("grpo", "full", "llama", "prompts, 3 updates a rollout", "lm-tiny-grpo", _grpo(3),
         kills=(2,), check=_grpo_checks(3)),
    Case("grpo", "full", "llama", "prompts", "lm-tiny-grpo",
         _grpo(1, "mesh.rules=fsdp_tp", "mesh.data=2", "mesh.tensor=2"), kills=(2,),
         devices=4, check=_grpo_checks(1)),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  return Inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(autouse=True)
def tests_importable(monkeypatch):
  """The test modules importable in the `jax-ai-stack train` children (GRPO's reward)."""
  here = str(pathlib.Path(__file__).parent)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get(
      "PYTHONPATH")])))


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_run_killed_and_resumed_is_the_run_that_never_stopped(case, inputs, tmp_path, capsys):
  overrides = case.overrides(inputs)
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  steps = config_lib.load(case.preset, overrides=overrides).train.steps
  for step in case.kills:
    killed_at = kill_at_step(case.preset, killed, overrides, step, devices=case.devices)
    assert killed_at < steps, "the run finished before the kill; the case proves nothing"
  capsys.readouterr()
  if case.devices == 1:
    digests = finish_both(case.preset, overrides, whole, killed)
  else:
    digests = run_on_devices("finish_both", case.preset, overrides, str(whole), str(killed),
                             devices=case.devices)
  out = capsys.readouterr().out
  assert len(records(whole, "train")) == steps
  assert records(killed, "train") == records(whole, "train")  # Every loss, gradient, reward.
  assert records(killed, "eval") == records(whole, "eval")
  assert digests["killed"] == digests["whole"]
  assert not list((killed / train.CHECKPOINT_DIR).glob("*.orbax-checkpoint-tmp*"))
  if case.check is not None:
    case.check(whole, out)
