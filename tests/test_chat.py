"""Chat data: JSONL conversations, the loss on the assistant's tokens, packed rows."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from jax_ai_stack.errors import ConfigError, DataError
from jax_ai_stack.recipes import configlib, train
from jax_ai_stack.recipes.data import DataConfig, preference
from jax_ai_stack.recipes.data.chat import (ChatRows, load_chat, read_jsonl,
                                            stdlib_conversations, tokenize)
from jax_ai_stack.recipes.data.chat_template import BYTE_TEMPLATE, ChatTemplate
from jax_ai_stack.recipes.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from data_helpers import read_batches
from training_helpers import TINY

REFERENCES = pathlib.Path(__file__).parent / "references" / "chat_templates"
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
BYTES = ChatTemplate(BYTE_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")


def _jsonl(path: pathlib.Path, lines) -> str:
  path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                          for line in lines), encoding="utf-8")
  return str(path)


def test_the_mask_covers_exactly_the_assistant_s_tokens_byte_by_byte():
  tokenizer = ByteTokenizer()
  ids, mask = tokenize(BYTES, tokenizer, TALK)
  text = BYTES.render(TALK)
  expected = np.zeros(len(ids), bool)  # From the rendered text: the replies and their EOS.
  for reply in ("hello<|eos|>\n", "4<|eos|>\n"):
    start = len(tokenizer.encode_rendered(text[:text.index(reply)]))
    expected[start:start + len(tokenizer.encode_rendered(reply))] = True
  assert mask.tolist() == expected.tolist()
  assert ids[mask].tolist() == [*b"hello", 257, 10, ord("4"), 257, 10]
  assert ids[0] == tokenizer.bos_id and (ids == tokenizer.eos_id).sum() == 2


def _qwen_tokenizer(tmp_path) -> HuggingFaceTokenizer:
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator([m["content"] for m in TALK] * 20 + ["system user assistant"], trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  return HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))


def test_a_tokenizer_file_s_own_turn_tokens_end_each_reply(tmp_path):
  tokenizer = _qwen_tokenizer(tmp_path)
  template = ChatTemplate((REFERENCES / "qwen.jinja").read_text(), bos_token="",
                          eos_token="<|im_end|>")
  ids, mask = tokenize(template, tokenizer, TALK)
  end = tokenizer._tok.token_to_id("<|im_end|>")  # pylint: disable=protected-access
  start = tokenizer._tok.token_to_id("<|im_start|>")  # pylint: disable=protected-access
  assert (ids == end).sum() == 5 and (ids[mask] == end).sum() == 2  # Each reply's own end.
  assert start not in ids[mask].tolist()
  assert tokenizer.decode(ids[mask]).split("\n") == ["hello", "4", ""]
  whole = np.concatenate([tokenizer.encode(text) for text, _ in template.pieces(TALK)])
  assert ids.tolist() == whole.tolist()


def test_rows_pack_whole_conversations_each_a_segment_and_count_what_is_cut():
  tokenizer = ByteTokenizer()
  short = tokenize(BYTES, tokenizer, TALK[1:3])  # 34 tokens: 33 (input, target) pairs.
  long = tokenize(BYTES, tokenizer, [{"role": "user", "content": "x" * 30},
                                     {"role": "assistant", "content": "y" * 30}])
  hopeless = tokenize(BYTES, tokenizer, [{"role": "user", "content": "z" * 80},
                                         {"role": "assistant", "content": "w"}])
  conversations = [short, short, long, hopeless, short]
  rows = ChatRows(*zip(*conversations), seq_len=72, pad_id=tokenizer.pad_id, description="t")
  assert rows.stats == {"conversations": 4, "truncated": 2, "dropped": 1}
  batch = rows(np.arange(rows.num_examples))
  assert rows.num_examples == 3  # [short, short], [long cut to 73 tokens], [short].
  assert batch["segment_ids"][0].max() == 2 and batch["segment_ids"][1].min() == 1
  assert (batch["positions"][0][batch["segment_ids"][0] == 2] == np.arange(33)).all()
  assert batch["inputs"][1].tolist() == long[0][:72].tolist()  # Its first seq_len + 1 tokens.
  padding = batch["segment_ids"] == 0
  assert (batch["loss_mask"][padding] == 0).all() and (batch["inputs"][padding] == 258).all()
  np.testing.assert_array_equal(batch["targets"][0][:33], short[0][1:])
  np.testing.assert_array_equal(batch["loss_mask"][0][:33], short[1][1:])


@pytest.mark.parametrize("line,message", [
    ("{not json", r"t.jsonl:2: not JSON \(Expecting property name .* at column 2\)"),  # The line's.
    ({"messages": [{"role": "robot", "content": "x"}]},
     r"t.jsonl:2: message 0 has role 'robot'; roles: system, user, assistant"),
    ({"messages": [{"role": "user", "content": "x"}]},
     "t.jsonl:2: the conversation has no assistant turn"),
    ({"text": "x"}, r't.jsonl:2: a line holds "messages"'),
    ({"prompt": "x", "completion": ""}, r"t.jsonl:2: message 1 \(assistant\) has no text"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, message):
  path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "completion": "b"}, line])
  with pytest.raises(DataError, match=message):
    read_jsonl([pathlib.Path(path)], max_bad_lines=0)


@pytest.mark.parametrize("parse", [read_jsonl, preference.read_pairs])
def test_a_line_cut_short_is_named_at_its_last_column_not_the_next_lines_first(tmp_path, parse):
  """`for line in file` keeps the "\\n": the parser stopped there, at "line 2, column 1"."""
  cut = '{"prompt": "reverse hello", "chosen": "olleh", "rejected": "hello", "completion": "x"'
  path = tmp_path / "t.jsonl"
  path.write_text(cut + "\n", encoding="utf-8")
  with pytest.raises(DataError, match=rf"t.jsonl:1: not JSON \(Expecting ',' delimiter at "
                                      rf"column {len(cut) + 1}, the end of the line"):
    parse([path], 0)


def test_a_few_bad_lines_are_skipped_and_counted_up_to_the_limit(tmp_path):
  path = pathlib.Path(_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "completion": "b"}, "{",
                                                    "", "[1]", {"prompt": "c", "completion": "d"}]))
  conversations, skipped = read_jsonl([path], max_bad_lines=2)
  assert skipped == 2 and [m[1]["content"] for _, m in conversations] == ["b", "d"]
  with pytest.raises(DataError, match=r"t.jsonl:2: not JSON .* \(2 bad lines; "
                                      r"data.max_bad_lines=1 skips that many\)"):
    read_jsonl([path], max_bad_lines=1)


def _config(tmp_path, **fields):
  lines = [line for i in range(20) for line in (
      {"messages": [*TALK[:-1], {"role": "assistant", "content": f"{i}"}]},
      {"prompt": f"Say yes {i} times.", "completion": "yes"})]
  return DataConfig(**{"source": "chat", "paths": (_jsonl(tmp_path / "c.jsonl", lines),),
                       "seq_len": 64, "batch_size": 2, "validation_fraction": 0.3,
                       "prefetch_batches": 0, **fields})


def test_chat_batches_come_through_the_pipeline_and_resume(tmp_path):
  config = _config(tmp_path)
  batches = read_batches(config, 4)
  assert set(batches[0]) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
  assert all(0 < b["loss_mask"].sum() < b["loss_mask"].size for b in batches)
  validation = read_batches(config, split="validation")
  assert validation and validation[0]["inputs"].shape == (2, 64)
  splits = load_chat(config)
  assert splits["train"].stats["conversations"] + splits["validation"].stats["conversations"] == 40


@pytest.mark.parametrize("source", ["chat", "preference"])
def test_a_set_too_small_to_hold_out_a_batch_names_a_fraction_that_does(source, tmp_path):
  replies = [("yes", "no") if i % 2 else ("no", "yes") for i in range(60)]
  path = _jsonl(tmp_path / "small.jsonl", [
      {"prompt": f"Is {i} odd?", **({"completion": reply} if source == "chat" else
                                   {"chosen": reply, "rejected": other})}
      for i, (reply, other) in enumerate(replies)])
  config = _config(tmp_path, source=source, paths=(path,), batch_size=4,
                   validation_fraction=0.02)
  with pytest.raises(DataError) as raised:
    read_batches(config, split="validation")
  fraction = re.search(r"\(data.validation_fraction=0.02\) and a batch takes about \d+; set "
                       r"data.validation_fraction=([\d.]+) to hold out about a batch, lower "
                       r"data.batch_size, or add (conversations|preference pairs) \(about \d+ in all hold out "
                       r"a batch at data.validation_fraction=0.02\)$",
                       str(raised.value))
  assert fraction, raised.value
  assert "(now" not in str(raised.value) and "Rows(" not in str(raised.value)  # No repr.
  held_out = read_batches(dataclasses.replace(config, validation_fraction=float(fraction[1])),
                          split="validation")
  assert held_out and {len(column) for column in held_out[0].values()} == {4}


def test_a_template_file_of_one_s_own_renders_the_conversations(tmp_path):
  (tmp_path / "mine.jinja").write_text(
      "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}")
  config = _config(tmp_path, chat_template=str(tmp_path / "mine.jinja"))
  rows = load_chat(config)["train"]
  text = ByteTokenizer().decode(rows(np.arange(1))["inputs"][0])
  assert text.startswith("s: Be brief.\nu: hi\na: hello\n")


def test_chat_data_is_not_cached_on_disk():
  with pytest.raises(ConfigError, match="data.cache: source='chat' is rendered and packed"):
    configlib.from_dict(DataConfig, {"source": "chat", "paths": ["c.jsonl"], "cache": "c/"})


def test_the_standard_library_gives_question_and_answer_pairs():
  pairs = list(stdlib_conversations(("json/*",)))
  assert pairs and all(len(m) == 2 and m[1]["role"] == "assistant" for _, m in pairs)
  keys = [key for key, _ in pairs]
  assert "json.dumps" not in keys or len(pairs[keys.index("json.dumps")][1][0]["content"]) < 80
  assert all(keys.count(k) == 2 for k in keys)  # Both directions, one split for both.


def _cli(*args, cwd):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", *TINY,
                         *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_a_chat_run_trains_on_the_replies_and_evaluates_them(tmp_path):
  path = _jsonl(tmp_path / "short.jsonl", [{"prompt": f"{i}", "completion": "ok"} if i % 4
                                           else {"prompt": f"{i}" * 8, "completion": "long"}
                                           for i in range(40)])
  overrides = [f"data.paths=[{path}]", "data.source=chat", "data.seq_len=32",
               "data.validation_fraction=0.3", "train.steps=4", "train.eval_every=4",
               "train.sample_tokens=0"]
  result = _cli("--workdir", str(tmp_path / "run"), *overrides, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  assert "note: train split:" in result.stderr  # The long ones are cut (and dropped).
  assert "note: validation split: " in result.stderr  # Its counts too, though it lost nothing.
  assert "note: chat template: the built-in chat template" in result.stderr
  evaluated = [r for r in train.read_metrics(tmp_path / "run") if r["split"] == "eval"]
  assert evaluated and np.isfinite(evaluated[-1]["eval_loss"])
  questions = _jsonl(tmp_path / "q.jsonl", [{"prompt": "1"}, {"messages": [
      {"role": "user", "content": "3"}]},
      {"prompt": "4", "completion": "answered"}])
  generate = [sys.executable, "-m", "jax_ai_stack.cli", "generate", "--workdir",
              str(tmp_path / "run"), "--chat", questions, "--max-new-tokens", "2", "--seed", "0"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(generate, capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 2, result.stderr  # The third line is answered already.
  assert result.stderr.strip().endswith("q.jsonl:3: the last turn is the assistant's; the "
                                        "model answers a conversation that ends with a user turn")
  (tmp_path / "q.jsonl").write_text("\n".join((tmp_path / "q.jsonl").read_text().splitlines()[:2]))
  result = subprocess.run(generate, capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0, result.stderr
  assert len(result.stdout.splitlines()) >= 2  # A reply per conversation.


def test_a_bad_line_stops_the_command_in_one_line_naming_it(tmp_path):
  path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"},
                                         {"messages": [{"role": "user", "content": "x"}]}])
  result = _cli("--workdir", str(tmp_path / "run"), "data.source=chat", f"data.paths=[{path}]",
                cwd=tmp_path)
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "bad.jsonl:2: the conversation has no assistant turn" in lines[0]
  assert not (tmp_path / "run").exists()


def test_a_reply_is_rendered_with_the_generation_prompt_and_stops_at_its_end_of_turn(
    monkeypatch):
  from jax_ai_stack.recipes import config as config_lib, inference
  from jax_ai_stack.recipes.inference.engine import Completion
  from jax_ai_stack.recipes.tasks.lm import LanguageModel

  task = LanguageModel(config_lib.load("lm-tiny-sft"))
  asked = []

  class FakeEngine:  # Answers "yes", EOS, then what follows.
    def __init__(self, model, max_slots, max_len=None, decode=None, grammar_vocabulary=None,
                 speculation=None):
      del model, max_slots, max_len, decode, grammar_vocabulary, speculation

    def check(self, request, index):  # The request fits: the settings are in range.
      del request, index

    def stream(self, requests):
      asked.extend(np.asarray(r.prompt) for r in requests)
      assert 257 in requests[0].stop_ids  # The engine stops at the end of the turn ...
      yield Completion(0, [*b"yes", 257, *b"more"], [0.0] * 8, "stop")  # ... and it is cut.

  monkeypatch.setattr(inference, "Engine", FakeEngine)
  messages = [{"role": "user", "content": "ok?"}]
  assert task.chat(None, messages, 8, 0.0, 0) == "yes"
  rendered = BYTES.render(messages, add_generation_prompt=True)
  assert rendered.endswith("<|assistant|>\n")
  assert asked[0].tolist() == ByteTokenizer().encode_rendered(rendered).tolist()


def test_a_tokenizer_file_s_turn_tokens_end_a_reply(tmp_path):
  tokenizer = _qwen_tokenizer(tmp_path)
  end = tokenizer._tok.token_to_id("<|im_end|>")  # pylint: disable=protected-access
  assert tokenizer.end_of_turn_ids() == [tokenizer.eos_id, end]
  assert ByteTokenizer().end_of_turn_ids() == [257]




@pytest.mark.parametrize("source", ["chat", "preference", "prompts"])
def test_the_end_of_run_sample_answers_a_held_out_prompt_of_the_runs_own_data(tmp_path, source):
  """It continued "def " whatever the data: now a chat, DPO or RL run's sample is the reply
  to the opening of its first held-out conversation (or pair, or prompt)."""
  from jax_ai_stack.recipes.tasks.lm import LanguageModel  # pylint: disable=g-import-not-at-top
  rows = [{"messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"Is {i} odd?"},
                        {"role": "assistant", "content": "yes" if i % 2 else "no"}],
           "chosen": "yes" if i % 2 else "no", "rejected": "no" if i % 2 else "yes",
           "prompt": f"Is {i} odd?", "answer": "yes" if i % 2 else "no"} for i in range(40)]
  for row in rows:  # Each source's own shape.
    if source == "chat":
      del row["chosen"], row["rejected"], row["prompt"], row["answer"]
    elif source == "preference":
      del row["messages"], row["answer"]
    else:
      del row["messages"], row["chosen"], row["rejected"]
  path = _jsonl(tmp_path / "d.jsonl", rows)
  overrides = [*TINY, f"data.source={source}", f"data.paths=[{path}]", "data.seq_len=128",
               "model.max_seq_len=128", "train.sample_prompt=null", "finetune.base=runs/base"]
  if source == "prompts":
    overrides += ["rl.rewards=[jax_ai_stack.recipes.rl.rewards:exact_answer]",
                  "rl.reward_weights=null"]
  cfg = configlib_load("lm-tiny-sft", overrides)
  item = LanguageModel(cfg).sample_item()
  if source == "prompts":  # As its rollouts give it: the text as its data has it.
    from jax_ai_stack.recipes.data import prompts  # pylint: disable=g-import-not-at-top
    assert item == {"prompt": prompts.load_prompts(cfg.data)["validation"].records[0]["prompt"]}
  else:
    *before, question = item["messages"]
    assert question["role"] == "user" and question["content"].startswith("Is ")
    if source == "chat":
      assert before == [{"role": "system", "content": "Be brief."}]
    validation = (load_chat(cfg.data) if source == "chat" else
                  preference.load_preferences(cfg.data))["validation"]
    assert validation.num_examples and item["messages"] == validation.prompt
  text = configlib_load("lm-tiny", [*TINY, "train.sample_prompt=null"])
  assert LanguageModel(text).sample_item() == {"prompt": "def "}  # A text run's, as before.
  given = configlib_load("lm-tiny-sft", [*TINY, "train.sample_prompt=Hi"])
  assert LanguageModel(given).sample_item() == {"messages": [{"role": "user", "content": "Hi"}]}


def configlib_load(preset, overrides):
  from jax_ai_stack.recipes import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.load(preset, overrides=overrides)


@pytest.mark.slow
def test_a_chat_runs_sample_file_shows_the_held_out_turns_and_the_reply(tmp_path):
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"Is {i} odd?", "completion": "yes"}
                                       for i in range(40)])
  cfg = configlib_load("lm-tiny-sft", [
      *TINY, "data.source=chat", f"data.paths=[{path}]", "data.seq_len=64",
      "model.max_seq_len=128", "train.sample_prompt=null", "finetune.base=null",
      "train.steps=2", "train.eval_every=0", "train.sample_temperature=0"])
  train.run(cfg, tmp_path / "run")
  validation = load_chat(cfg.data)["validation"]
  sample = (tmp_path / "run" / "sample.txt").read_text(encoding="utf-8")
  assert sample.startswith(f"user: {validation.prompt[0]['content']}\nassistant: "), sample
