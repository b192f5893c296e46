"""Preference pairs: parsed by line, rendered with the chat template, one row per side; DPO
and chat SFT from a base (their runs killed and resumed: test_kill_and_resume.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.data import DataConfig
from jax_ai_stack.recipes.data.chat_template import BYTE_TEMPLATE, ChatTemplate
from jax_ai_stack.recipes.data.preference import (PreferenceRows, load_preferences, parse_pair,
                                                  read_pairs, stdlib_pairs)
from jax_ai_stack.recipes.data.tokenizers import ByteTokenizer
from data_helpers import read_batches

BYTES = ChatTemplate(BYTE_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")
TALK = [{"role": "user", "content": "hi"}]


def test_both_line_forms_give_the_prompt_and_two_replies():
  assert parse_pair('{"prompt": "hi", "chosen": "hello", "rejected": "go"}', "p:1") == (
      TALK, "hello", "go")
  both = {side: [*TALK, {"role": "assistant", "content": reply}]
          for side, reply in (("chosen", "hello"), ("rejected", "go"))}
  assert parse_pair(json.dumps(both), "p:1") == (TALK, "hello", "go")


@pytest.mark.parametrize("record,message", [
    ({"prompt": "hi", "chosen": "same", "rejected": "same"},
     '"chosen" and "rejected" are the same reply'),
    ({"prompt": "hi", "chosen": "a"}, 'a line holds "chosen" and "rejected"'),
    ({"chosen": [*TALK, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
     "must be the same conversation up to their last turn"),
    ({"chosen": [*TALK, {"role": "robot", "content": "a"}], "rejected": TALK},
     r"p.jsonl:3 \(chosen\): message 1 has role 'robot'"),
    ({"prompt": "hi", "chosen": "", "rejected": "b"}, '"chosen" has no text'),
])
def test_a_bad_pair_is_named_by_file_and_line(tmp_path, record, message):
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n' + json.dumps(record) + "\n")
  with pytest.raises(DataError, match=message) as error:
    read_pairs([path], max_bad_lines=0)
  assert "p.jsonl:3" in str(error.value)


def test_each_side_is_a_row_whose_mask_is_its_reply():
  tokenizer = ByteTokenizer()
  rows = PreferenceRows([(TALK, "hello", "go away"), ([{"role": "user", "content": "x" * 40}],
                                                       "y", "z")],
                        BYTES, tokenizer, seq_len=40, description="two")
  assert rows.stats == {"pairs": 1, "truncated": 2, "dropped": 1}
  batch = rows(np.arange(rows.num_examples))
  for side, reply in (("chosen", "hello"), ("rejected", "go away")):
    targets, mask = batch[f"{side}_targets"][0], batch[f"{side}_loss_mask"][0]
    assert tokenizer.decode(targets[mask > 0]) == reply + "\n"
    assert (targets[mask > 0] == tokenizer.eos_id).sum() == 1
  np.testing.assert_array_equal(batch["chosen_inputs"][0][:20], batch["rejected_inputs"][0][:20])


def test_the_standard_library_gives_right_and_wrong_answers():
  pairs = stdlib_pairs(("json/*", "textwrap.py", "shlex.py"))
  assert pairs and all(chosen != rejected for _, chosen, rejected in pairs)
  assert all(prompt[0]["role"] == "user" and len(prompt) == 1 for prompt, _, _ in pairs)


def test_pairs_come_through_the_pipeline_split_by_prompt(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}?", "chosen": "yes", "rejected": "no"})
                          + "\n" for i in range(40)))
  config = DataConfig(source="preference", paths=(str(path),), seq_len=32, batch_size=2,
                      validation_fraction=0.3, prefetch_batches=0)
  batch = read_batches(config, 1)[0]
  assert sorted(batch) == sorted(f"{side}_{key}" for side in ("chosen", "rejected") for key in
                                 ("inputs", "targets", "segment_ids", "positions", "loss_mask"))
  splits = load_preferences(config)
  assert splits["train"].num_examples + splits["validation"].num_examples == 40
  assert splits["validation"].num_examples > 0


BASE = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=32", "data.batch_size=4",
        "data.validation_fraction=0.3", "train.progress=false", "train.sample_tokens=0",
        "optim.warmup_steps=1", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def pairs_and_base(tmp_path_factory):
  """A JSONL file of 60 pairs ("yes" over "no") and a 2-step lm-tiny base."""
  tmp = tmp_path_factory.mktemp("dpo")
  path = tmp / "p.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}", "chosen": "yes", "rejected": "no"})
                          + "\n" for i in range(60)))
  train.run(config_lib.load("lm-tiny", overrides=[*BASE, "data.max_documents=30",
                                                  "train.steps=2"]), tmp / "base")
  return path, tmp / "base"


DPO_STEPS = 8


def _dpo_overrides(pairs_and_base, tuning: str) -> list[str]:
  path, base = pairs_and_base
  lora = "finetune.lora={rank: 4}" if tuning == "lora" else "finetune.lora=null"
  return [*BASE, "data.source=preference", f"data.paths=[{path}]", f"finetune.base={base}", lora,
          f"train.steps={DPO_STEPS}", "train.eval_every=4", "checkpoint.save_every=1",
          "optim.learning_rate=0.01" if tuning == "lora" else "optim.learning_rate=0.002"]


def test_the_dry_run_states_the_frozen_copy_of_full_fine_tuning(pairs_and_base):
  from jax_ai_stack.recipes import memory

  overrides = _dpo_overrides(pairs_and_base, "full")
  full = memory.estimate_memory(config_lib.load("lm-tiny-dpo", overrides=overrides), 1,
                                attention="xla")
  lora = memory.estimate_memory(config_lib.load("lm-tiny-dpo", overrides=[
      *overrides, "finetune.lora={rank: 4}"]), 1, attention="xla")
  assert full.reference == full.parameters > 0 and "  reference " in full.describe()
  assert lora.reference == 0 and "reference" not in lora.describe()
  assert lora.optimizer < full.optimizer / 10  # LoRA's optimizer holds the adapters' moments.


@pytest.mark.slow
def test_dpo_trains_another_family_with_its_own_template(pairs_and_base, tmp_path):
  """Qwen3 (q/k norms, its ChatML-style template for the byte tokenizer's stand-in): the run
  starts at the reference and learns the preference."""
  from test_families import PRESET_SIZE

  path, _ = pairs_and_base
  size = [*PRESET_SIZE, *BASE, "model.layer_types=[sliding]",  # BASE's one layer.
          "model.max_seq_len=128", "data.seq_len=128"]  # Its system turn.
  base = config_lib.load("qwen3-tiny", overrides=[*size, "data.max_documents=30",
                                                  "train.steps=1"])
  train.run(base, tmp_path / "base")
  template = pathlib.Path(__file__).parent / "references" / "chat_templates" / "qwen.jinja"
  dpo = config_lib.load("qwen3-tiny", overrides=[
      *size, "data.source=preference", f"data.paths=[{path}]",
      f"data.chat_template={template}", f"finetune.base={tmp_path / 'base'}",
      "finetune.lora={rank: 4}", "train.steps=6", "train.eval_every=6",
      "optim.learning_rate=0.01"])
  train.run(dpo, tmp_path / "dpo")
  evals = [r for r in train.read_metrics(tmp_path / "dpo") if r["split"] == "eval"]
  assert evals[0]["eval_loss"] == pytest.approx(np.log(2), abs=1e-6)
  assert evals[-1]["eval_preference_accuracy"] == 1.0 and evals[-1]["eval_loss"] < np.log(2)


def test_pairs_whose_replies_do_not_fit_are_named_when_nothing_is_left(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "x" * 80, "chosen": "a", "rejected": "b"}) + "\n")
  config = DataConfig(source="preference", paths=(str(path),), seq_len=32, batch_size=1,
                      validation_fraction=0.0, prefetch_batches=0)
  with pytest.raises(DataError, match=r"the train split has 0 rows of preference pairs and "
                                      r"needs 1: .*1 preference pairs were dropped, their "
                                      r"assistant turn beyond data.seq_len \+ 1 = 33 tokens"):
    read_batches(config, 1)
