"""HarnessModel: lm-evaluation-harness's questions answered by a decoder, as training scores
and as the engine generates, and as the harness's own `hf` backend scores each family
(tests/references/harness/, from scripts/make_harness_references.py)."""

import json
import pathlib

import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

from jax_ai_stack.recipes import data, inference, models
from jax_ai_stack.recipes.evaluation.harness_model import (HarnessModel, decodes_as_it_scores,
                                                          pack, shared_contexts)
from jax_ai_stack.recipes.finetune import adapters
from jax_ai_stack.recipes.finetune.config import LoraConfig
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.tasks import objectives

TOKENIZER = data.ByteTokenizer()
REFERENCES = pathlib.Path(__file__).parent / "references"
FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="module")
def model():
  config = models.DecoderConfig.tiny()
  return models.Decoder(config, rngs=nnx.Rngs(0))


def instance(kind, args, index=0):
  return Instance(request_type=kind, doc={}, arguments=args, idx=index)


def training_logps(model, ids):
  """log p of each next token of `ids` as the objectives compute it (float32)."""
  ids = np.asarray([ids], np.int32)
  return np.asarray(objectives.target_logps(model, ids[:, :-1], ids[:, 1:]))[0]


def test_a_continuation_scores_as_the_training_objective_does(model):
  harness = HarnessModel(model, TOKENIZER, batch_size=4)
  pairs = [("The cat", " sat"), ("def f(x):", " return x"), ("a", "b")]
  results = harness.loglikelihood([instance("loglikelihood", pair) for pair in pairs],
                                  disable_tqdm=True)
  for (context, continuation), (logp, _) in zip(pairs, results):
    ids = list(TOKENIZER.encode(context + continuation))
    expected = training_logps(model, ids)[-len(continuation.encode()):].sum()
    assert logp == pytest.approx(float(expected), abs=1e-5)


def test_is_greedy_says_whether_each_continuation_token_is_the_likeliest(model):
  harness = HarnessModel(model, TOKENIZER, batch_size=2)
  context = list(TOKENIZER.encode("Hello"))
  greedy = inference.Engine(model, max_slots=1).run(
      [inference.Request(tuple(context), 3, temperature=0)])[0].tokens
  other = [(greedy[0] + 1) % 256, *greedy[1:]]
  results = harness._loglikelihood_tokens([(None, context, greedy), (None, context, other)],
                                          disable_tqdm=True)
  assert [is_greedy for _, is_greedy in results] == [True, False]


def test_a_request_scores_the_same_alone_and_packed_among_longer_ones(model):
  """In a row with others (its own segment and positions), as alone."""
  harness = HarnessModel(model, TOKENIZER, batch_size=4, packed=True)
  request = (None, [97, 98], [99, 100])
  alone = harness._loglikelihood_tokens([request], disable_tqdm=True)[0]
  crowd = [(None, list(range(1, 40)), [5, 6, 7]), request, (None, [1] * 20, [2])]
  assert len(pack([41, 3, 20], 64)) == 1  # The three share one row.
  among = harness._loglikelihood_tokens(crowd, disable_tqdm=True)
  assert among[1][0] == pytest.approx(alone[0], abs=1e-5) and among[1][1] == alone[1]
  for (_, context, continuation), (logp, _) in zip(crowd, among):
    expected = training_logps(model, context + continuation)[-len(continuation):].sum()
    assert logp == pytest.approx(float(expected), abs=1e-5)


def test_on_cpu_each_request_has_a_row_of_its_own_and_scores_as_packed(model):
  """The CPU default (no segment mask: the blocked attention's fast path) gives the packed
  scores, batches sorted longest first."""
  crowd = [(None, list(range(1, 40)), [5, 6, 7]), (None, [97, 98], [99, 100]),
           (None, [1] * 20, [2]), (None, [3] * 70, [4, 5])]
  default = HarnessModel(model, TOKENIZER, batch_size=2)
  assert not default._packed
  alone = default._loglikelihood_tokens(crowd, disable_tqdm=True)
  packed = HarnessModel(model, TOKENIZER, batch_size=2, packed=True)._loglikelihood_tokens(
      crowd, disable_tqdm=True)
  for (a, a_greedy), (p, p_greedy) in zip(alone, packed):
    assert a == pytest.approx(p, abs=1e-5) and a_greedy == p_greedy


def choices(seed: int, vocab: int, contexts=(40, 70, 100, 36), count: int = 4) -> list[tuple]:
  """`count` continuations (1-6 tokens) after each of `contexts` (lengths), and a request of
  its own."""
  rng = np.random.default_rng(seed)
  asked = []
  for length in contexts:
    context = rng.integers(1, vocab, length).tolist()
    asked += [(None, context, rng.integers(1, vocab, int(rng.integers(1, 7))).tolist())
              for _ in range(count)]
  return asked + [(None, rng.integers(1, vocab, 50).tolist(), [3, 4])]


def test_choices_after_one_context_score_as_each_alone_and_as_training_does(model):
  """The contexts' keys and values computed once for all their choices, then each choice's
  own tokens read them: the scores of each request alone in its row (and of training), the
  same greedy flags; the request without a sibling goes through its own row."""
  asked = choices(0, 256, contexts=(40, 70), count=3)
  sequences = [c + t for _, c, t in asked]
  assert len(shared_contexts(sequences, [len(t) for *_, t in asked])) == 2
  shared, alone = (HarnessModel(model, TOKENIZER, batch_size=2, share_contexts=share
                                )._loglikelihood_tokens(asked, disable_tqdm=True)
                   for share in (True, False))
  np.testing.assert_allclose([l for l, _ in shared], [l for l, _ in alone], atol=1e-5, rtol=0)
  assert [g for _, g in shared] == [g for _, g in alone]
  _, context, continuation = asked[4]
  expected = training_logps(model, context + continuation)[-len(continuation):].sum()
  assert shared[4][0] == pytest.approx(float(expected), abs=1e-5)


def test_qwix_lora_scores_without_sharing_contexts(model):
  """Qwix puts the adapters in front of `__call__` alone, so `decode` would score the base:
  sharing is off by default, and asking for it is refused, naming why."""
  config = models.DecoderConfig.tiny()
  adapted = adapters.add_adapters(models.Decoder(config, rngs=nnx.Rngs(0)),
                                  LoraConfig(rank=2), config, seed=1)
  assert decodes_as_it_scores(model) and not decodes_as_it_scores(adapted)
  assert not HarnessModel(adapted, TOKENIZER)._share
  with pytest.raises(ValueError, match="share_contexts=True: Decoder.decode does not compute"):
    HarnessModel(adapted, TOKENIZER, share_contexts=True)


def test_a_rolling_log_likelihood_scores_disjoint_windows_as_the_harness_defines_them(model):
  harness = HarnessModel(model, TOKENIZER, batch_size=4, max_len=16)
  text = "import os, sys; print(os.getcwd())"  # 34 tokens: windows of 16, 16 and 2.
  [total] = harness.loglikelihood_rolling([instance("loglikelihood_rolling", (text,))],
                                          disable_tqdm=True)
  t = list(TOKENIZER.encode(text))
  assert len(t) == 34
  expected = (training_logps(model, [TOKENIZER.bos_id, *t[:16]]).sum()  # BOS, then 16.
              + training_logps(model, t[15:32]).sum()  # The next 16 after one token.
              + training_logps(model, t[17:34])[-2:].sum())  # The last 2 after 15.
  assert total == pytest.approx(float(expected), abs=1e-4)
  [whole] = HarnessModel(model, TOKENIZER, max_len=64).loglikelihood_rolling(
      [instance("loglikelihood_rolling", (text,))], disable_tqdm=True)
  assert whole == pytest.approx(float(training_logps(model, [TOKENIZER.bos_id, *t]).sum()),
                                abs=1e-4)


def test_generation_is_the_engines_greedy_text_cut_before_the_stop_string(model):
  harness = HarnessModel(model, TOKENIZER, batch_size=2)
  prompts = ["def f(", "x = 1\n", "Hello"]
  greedy = inference.Engine(model, max_slots=2).run(
      [inference.Request(tuple(TOKENIZER.encode(p)), 8, temperature=0,
                         stop_ids=(TOKENIZER.eos_id,)) for p in prompts])
  texts = [TOKENIZER.decode(c.tokens) for c in greedy]
  stop = texts[0][2:4]
  requests = [instance("generate_until", (p, {"until": [stop], "max_gen_toks": 8}), i)
              for i, p in enumerate(prompts)]
  outputs = harness.generate_until(requests, disable_tqdm=True)
  assert outputs == [t[:t.index(stop)] if stop in t else t for t in texts]
  assert outputs[0] == texts[0][:2]


SAMPLED = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}


def test_the_harness_s_repeats_of_a_sampled_request_are_samples_of_their_own(model):
  """lm-eval passes a request `repeats` times (self-consistency, pass@k): each repeat is
  seeded by the run's seed and its place, so they differ, and the same seed gives them
  again; greedy repeats agree."""
  harness = HarnessModel(model, TOKENIZER, batch_size=4, seed=3)
  repeats = [instance("generate_until", ("def f(", dict(SAMPLED)))] * 4
  outputs = harness.generate_until(repeats, disable_tqdm=True)
  assert len(set(outputs)) == 4
  again = HarnessModel(model, TOKENIZER, batch_size=2, seed=3)
  assert again.generate_until(repeats, disable_tqdm=True) == outputs
  other = HarnessModel(model, TOKENIZER, batch_size=4, seed=4)
  assert other.generate_until(repeats, disable_tqdm=True) != outputs
  greedy = [instance("generate_until", ("def f(", {**SAMPLED, "do_sample": False}))] * 3
  assert len(set(harness.generate_until(greedy, disable_tqdm=True))) == 1


REPEATED_TASK = """task: tiny_repeats
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
repeats: 3
generation_kwargs: {settings}
metric_list:
  - metric: exact_match
"""


def test_through_lm_eval_each_document_gets_its_repeats_count_of_different_samples(
    model, tmp_path):
  from lm_eval import evaluator
  from lm_eval.tasks import TaskManager

  data = tmp_path / "prompts.jsonl"
  data.write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n"
                          for p in ("def f(", "import ")))
  (tmp_path / "repeats.yaml").write_text(REPEATED_TASK.format(data=data,
                                                             settings=json.dumps(SAMPLED)))
  results = evaluator.simple_evaluate(
      model=HarnessModel(model, TOKENIZER, batch_size=4), tasks=["tiny_repeats"],
      task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
      bootstrap_iters=0)
  samples = results["samples"]["tiny_repeats"]
  assert len(samples) == 2
  for sample in samples:
    [responses] = sample["resps"]  # One instance, answered `repeats` times.
    assert len(responses) == 3 and len(set(responses)) == 3, responses


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_scores_as_the_harness_s_hf_backend_does(family):
  """The same requests (contexts longer than the window cut from the left, as the harness
  cuts them) give log-likelihoods within 1e-4 of transformers' through the harness, the same
  greedy flags, and so the same choice on each multiple-choice question whose best two
  choices the reference tells apart by more than that tolerance (a tie, two continuations
  the model scores alike, is any pick within float rounding)."""
  record = json.loads((REFERENCES / "harness" / f"{family}.json").read_text())
  harness = HarnessModel(hf.load_model(REFERENCES / "hf" / family), TOKENIZER, batch_size=4)
  assert harness.max_length == record["max_length"]
  asked = record["requests"]
  ours = harness._loglikelihood_tokens([(None, r["context"], r["continuation"]) for r in asked],
                                       disable_tqdm=True)
  theirs = [r["loglikelihood"] for r in asked]
  np.testing.assert_allclose([logp for logp, _ in ours], theirs, atol=1e-4, rtol=0)
  assert [greedy for _, greedy in ours] == [r["is_greedy"] for r in asked]
  questions, ours = np.asarray(theirs).reshape(-1, 4), np.asarray([l for l, _ in ours])
  best_two = np.sort(questions, axis=1)[:, -2:]
  told_apart = best_two[:, 1] - best_two[:, 0] > 2e-4
  assert told_apart.sum() >= len(questions) - 1, "a reference with more than one tie"
  assert (ours.reshape(-1, 4).argmax(axis=1) == questions.argmax(axis=1))[told_apart].all()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_scores_shared_contexts_as_unshared(family):
  """Sliding windows, soft caps, MoE: choices read their context's shared pages through the
  model's paged decode and score as each in its own row."""
  model = hf.load_model(REFERENCES / "hf" / family)
  asked = choices(1, model.config.vocab_size, contexts=(40,), count=3)
  shared, alone = (HarnessModel(model, TOKENIZER, batch_size=2, share_contexts=share
                                )._loglikelihood_tokens(asked, disable_tqdm=True)
                   for share in (True, False))
  np.testing.assert_allclose([l for l, _ in shared], [l for l, _ in alone], atol=1e-5, rtol=0)
  assert [g for _, g in shared] == [g for _, g in alone]


class WordTokenizer:
  """The reference script's stand-in: one word per id ("t7 t42"), EOS the last id; id 0
  is its padding (and unknown) token, which decoding leaves out, as transformers' does."""

  def __init__(self, vocab: int):
    self.eos_id = self.bos_id = vocab - 1

  def encode_rendered(self, text: str) -> np.ndarray:
    return np.asarray([int(word[1:]) for word in text.split()], np.int32)

  def decode(self, ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids if int(i) != 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_generates_the_harness_s_hf_backend_s_strings(family):
  """Greedy `generate_until` through the engine gives the strings the harness's `hf`
  backend gave on transformers: cut at the `until` word where one came, else ended by
  `max_gen_toks` or EOS; the longest context cut from the left to leave room."""
  record = json.loads((REFERENCES / "harness" / f"{family}-generate_until.json").read_text())
  model = hf.load_model(REFERENCES / "hf" / family)
  harness = HarnessModel(model, WordTokenizer(model.config.vocab_size), batch_size=4)
  assert harness.max_length == record["max_length"]
  asked = record["requests"]
  ours = harness.generate_until([instance("generate_until", (r["context"], dict(r["settings"])))
                                 for r in asked], disable_tqdm=True)
  assert ours == [r["string"] for r in asked]
  cut = [r for r in asked if r["settings"]["until"] != ["t0"]]  # A word of its greedy text.
  assert cut and all(len(r["string"].split()) < r["settings"]["max_gen_toks"] for r in cut)
