"""The generation engine: greedy tokens equal the plain loop's and transformers', a seeded
request gives the same tokens whatever else is in the batch, log-probs equal the training
objective's, requests end on their own, and bad requests are named."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes.inference import Engine, Request
from jax_ai_stack.recipes.models import hf
from jax_ai_stack.recipes.models.decoding import generate
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig, KVCache
from jax_ai_stack.recipes.sharding import MESH_AXES, Layout, logical_rules
from jax_ai_stack.recipes.sharding_config import MeshConfig
from jax_ai_stack.recipes.tasks import objectives

REFERENCES = pathlib.Path(__file__).parent / "references" / "hf"
RNG = np.random.default_rng(0)


def _prompts(vocab: int, lengths=(3, 17, 9)) -> list[tuple[int, ...]]:
  return [tuple(int(t) for t in RNG.integers(0, vocab, n)) for n in lengths]


@pytest.fixture(scope="module")
def tiny():
  return Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["llama-scanned", *(
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("gemma2", "mixtral", "qwen3", "mistral", "gemma3", "qwen3_moe",
                 "olmo2", "olmo3", "smollm3", "phi3", "qwen2_moe", "gpt_oss", "llama4",
                 "deepseek_v3-moe", "qwen3_next"))])
def test_greedy_tokens_equal_the_loop_s_for_mixed_prompt_lengths(name):
  """Two slots for three prompts: the third is admitted mid-way, into a freed slot."""
  if name == "llama-scanned":
    model = Decoder(dataclasses.replace(DecoderConfig.tiny(), scan_layers=True), rngs=nnx.Rngs(1))
  else:
    model = hf.load_model(REFERENCES / name)
  prompts = _prompts(model.config.vocab_size)
  done = Engine(model, max_slots=2).run([Request(p, 6, temperature=0) for p in prompts])
  for prompt, completion in zip(prompts, done):
    loop = generate(model, jnp.asarray([prompt]), 6, temperature=0, rng=jax.random.key(0))
    assert completion.tokens == np.asarray(loop)[0, len(prompt):].tolist(), (name, prompt)
    assert completion.finish_reason == "length"
  if name != "llama-scanned":  # And transformers' own greedy tokens (tests/test_families.py).
    ref = dict(np.load(REFERENCES / name / "reference.npz"))
    new = ref["greedy"].shape[1] - ref["prompt"].shape[1]
    rows = [tuple(int(t) for t in row) for row in ref["prompt"]]
    done = Engine(model, max_slots=4).run([Request(p, new, temperature=0) for p in rows])
    assert [c.tokens for c in done] == ref["greedy"][:, ref["prompt"].shape[1]:].tolist()


def test_a_pool_in_the_tpu_kernel_s_layout_decodes_the_xla_loop_s_tokens(monkeypatch):
  """Where the plan decodes with the TPU's ragged kernel, the pool is the kernel's own layout
  (no copy of a row's pages in each layer at each step): new keys and values written side by
  side, each head's pair, and the kernel reads the engine's own block table. Greedy tokens
  and log-probs equal the xla loop's over split pools. On this CPU the kernel's stand-in
  reads the pool as JAX's reference of it does (keys at even, values at odd heads; the
  reference itself loops in Python, not under jit: tests/test_kernels_paged.py runs it)."""
  import functools

  from jax_ai_stack import kernels
  from jax_ai_stack.kernels import paged, paged_tpu
  from jax_ai_stack.recipes.models import layers

  def kernel(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
             soft_cap, sliding_window):
    rows = page_indices.shape[0]
    q = queries.reshape(rows, -1, *queries.shape[1:])
    positions = kv_lens[:, None] - q.shape[1] + jnp.arange(q.shape[1])
    k_pages, v_pages = (jnp.moveaxis(kv_pages[:, :, i::2], 2, 0) for i in (0, 1))
    out = paged.paged_attention(q, k_pages, v_pages, page_indices, positions, scale=sm_scale,
                                logits_soft_cap=soft_cap, implementation="xla")
    return out.reshape(queries.shape)

  monkeypatch.setattr(layers, "pallas_tpu", functools.partial(paged_tpu.pallas_tpu, kernel=kernel))
  config = DecoderConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=128)
  plans = {name: kernels.AttentionPlan(("xla",), "a test", paged=name)
           for name in ("xla", "pallas_tpu")}
  models = {name: Decoder(config, rngs=nnx.Rngs(0), attention=plan) for name, plan in plans.items()}
  fused = models["pallas_tpu"].init_pages(5, 16)[0]
  assert list(fused) == ["kv"] and fused["kv"].shape == (5, 16, 4, 128)
  requests = [Request(p, 6, temperature=0, top_logprobs=1)
              for p in _prompts(config.vocab_size, [3, 17, 30])]
  loop, kernel = (Engine(models[name], max_slots=2).run(requests) for name in ("xla", "pallas_tpu"))
  assert [c.tokens for c in kernel] == [c.tokens for c in loop]
  np.testing.assert_allclose([c.logprobs for c in kernel], [c.logprobs for c in loop], atol=1e-5)


def test_a_seeded_request_is_the_same_alone_among_31_others_and_admitted_mid_way(tiny):
  mine = Request(_prompts(256, [7])[0], 12, temperature=0.9, top_k=50, top_p=0.95, seed=7)
  alone = Engine(tiny, max_slots=8).run([mine])[0]
  others = [Request(p, int(n), temperature=1.0, seed=s, top_p=0.9)
            for s, (p, n) in enumerate(zip(_prompts(256, RNG.integers(1, 40, 31)),
                                           RNG.integers(1, 16, 31)))]
  crowded = Engine(tiny, max_slots=8).run([*others[:20], mine, *others[20:]])[20]
  assert crowded.tokens == alone.tokens and crowded.logprobs == alone.logprobs
  assert len(set(alone.tokens)) > 3  # Sampled, not a greedy rut.
  other_seed = Engine(tiny, max_slots=8).run([Request(mine.prompt, 12, temperature=0.9,
                                                      top_k=50, top_p=0.95, seed=8)])[0]
  assert other_seed.tokens != alone.tokens


def test_reported_log_probs_equal_the_training_objective_s(tiny):
  prompt = _prompts(256, [11])[0]
  completion = Engine(tiny, max_slots=3).run([Request(prompt, 20, temperature=1.0, seed=3)])[0]
  sequence = jnp.asarray([[*prompt, *completion.tokens]])
  trained = objectives.target_logps(tiny, sequence[:, :-1], sequence[:, 1:])
  np.testing.assert_allclose(completion.logprobs, np.asarray(trained)[0, len(prompt) - 1:],
                             atol=1e-6, rtol=0)


def test_requests_end_at_a_stop_token_or_their_limit_and_free_their_slot(tiny):
  prompts = _prompts(256, [4, 6, 8])
  free = Engine(tiny, max_slots=1).run([Request(p, 8, temperature=0) for p in prompts])
  stop = free[0].tokens[2]  # The third greedy token of the first prompt ends it there.
  requests = [Request(prompts[0], 8, temperature=0, stop_ids=(stop,)),
              *[Request(p, 8, temperature=0) for p in prompts[1:]]]
  first, *rest = Engine(tiny, max_slots=1).run(requests)  # One slot: each waits its turn.
  assert first.tokens == free[0].tokens[:free[0].tokens.index(stop) + 1]
  assert first.finish_reason == "stop"
  assert [c.tokens for c in rest] == [c.tokens for c in free[1:]]


def test_a_completion_says_when_its_first_token_came_and_stays_equal_across_runs(tiny):
  """Time to first token counts from the request's queueing: one that waits for the slot
  has its first token later. The time is no part of a completion's equality."""
  requests = [Request(p, 6, temperature=0) for p in _prompts(256, [4, 6])]
  first, second = Engine(tiny, max_slots=1).run(requests)  # The second waits its turn.
  assert 0 < first.first_token_s < second.first_token_s
  assert Engine(tiny, max_slots=1).run(requests) == [first, second]  # Other times, equal.


def _text(ids) -> str:
  """A token's text: one character of its own (no bytes split over tokens)."""
  return "".join(chr(0x100 + t) for t in ids)


def test_a_stop_string_ends_a_request_in_the_engine_its_text_cut_before_it(tiny):
  """The request ends at the token that completes the stop string (the waiting request
  takes its slot); `text` holds what came before."""
  prompts = _prompts(256, [4, 6])
  free = Engine(tiny, max_slots=1, decode=_text).run(
      [Request(p, 12, temperature=0) for p in prompts])
  assert free[0].text == _text(free[0].tokens)
  stop = _text(free[0].tokens[3:5])  # Made by the fourth and fifth greedy tokens (or earlier).
  ends = next(k for k in range(1, 13) if stop in _text(free[0].tokens[:k]))
  first, second = Engine(tiny, max_slots=1, decode=_text).run(
      [Request(prompts[0], 12, temperature=0, stop=(stop,)), Request(prompts[1], 12,
                                                                     temperature=0)])
  assert first.finish_reason == "stop" and first.tokens == free[0].tokens[:ends]
  assert first.text == free[0].text[:free[0].text.index(stop)]
  assert second.tokens == free[1].tokens


def test_top_logprobs_are_the_likeliest_tokens_and_hold_the_greedy_one(tiny):
  completion = Engine(tiny, max_slots=2).run([Request((256, 1, 2), 4, temperature=0,
                                                      top_logprobs=3)])[0]
  assert len(completion.top_logprobs) == 4
  for token, logp, top in zip(completion.tokens, completion.logprobs, completion.top_logprobs):
    assert top[0] == (token, pytest.approx(logp)) and len(top) == 3
    assert top[0][1] >= top[1][1] >= top[2][1]


@pytest.mark.parametrize("request_, message", [
    (Request((), 4), "request 0: the prompt is empty"),
    (Request((1, 999), 4), r"prompt token ids must be in \[0, 259\)"),
    (Request((1,), 0), "max_tokens must be >= 1"),
    (Request((1,) * 120, 9), r"the prompt \(120 tokens\) and max_tokens \(9\) exceed the "
                             "context of 128 tokens"),
    (Request((1,), 4, temperature=-1), "temperature must be >= 0"),
    (Request((1,), 4, top_k=0), r"top_k must be in \[1, 259\]"),
    (Request((1,), 4, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (Request((1,), 4, stop_ids=(300,)), r"stop token ids must be in \[0, 259\); got \[300\]"),
    (Request((1,), 4, top_logprobs=9), r"top_logprobs must be in \[0, 5\]"),
    (Request((1,), 4, stop=("\n",)), "stop strings need the tokenizer"),
    (Request((1,), 4, logit_bias=((300, 1.0),)), r"logit_bias: at most 300 token ids in \[0, "
                                                  r"259\), each with a value in \[-100, 100\]; "
                                                  r"got 1 \(300: 1.0\)"),
    (Request((1,), 4, logit_bias=((3, -101.0),)), r"got 1 \(3: -101.0\)"),
    (Request((1,), 4, logit_bias=tuple((t, 1.0) for t in range(301))), r"got 301 \(0: 1.0, "
                                                                        r"1: 1.0, 2: 1.0, ...\)"),
])
def test_a_bad_request_is_named_with_its_field(tiny, request_, message):
  with pytest.raises(ValueError, match=message):
    Engine(tiny, max_slots=1).run([request_])


def test_requests_join_a_running_engine_and_a_cancelled_one_frees_its_slot(tiny):
  """A server's use: add at any moment, step a call at a time, cancel a gone client's."""
  a, b, c = (Request(p, 10, temperature=0.8, seed=s) for s, p in enumerate(_prompts(256)))
  engine = Engine(tiny, max_slots=2)
  first, second = engine.add(a), engine.add(b)
  grown = engine.step()  # Both admitted (prefill's token) and one call decoded.
  new = 1 + engine.steps_per_call
  assert [(g.index, len(g.tokens)) for g in grown] == [(first, new), (second, new)]
  assert engine.free_slots == 0
  third = engine.add(c)
  assert engine.step() and engine.free_slots == 0  # c waits for a slot.
  assert engine.cancel(first) and engine.free_slots == 1 and not engine.cancel(first)
  tokens = {}
  while engine.busy:
    for completion in engine.step():
      if completion.finish_reason:
        tokens[completion.index] = completion.tokens
  assert engine.free_slots == 2 and sorted(tokens) == [second, third]
  assert engine.pages_in_use == 0  # The cancelled request's pages came back too.
  alone = Engine(tiny, max_slots=2).run([b, c])
  assert [tokens[second], tokens[third]] == [done.tokens for done in alone]


def test_a_small_pool_of_pages_admits_requests_as_pages_free_and_gives_the_same_tokens(tiny):
  """Eight slots but a pool of 6 pages of 8 positions: a request holds the pages of its
  prompt and max_tokens, so at most three of these (2 pages each) run at once, and the
  rest wait their turn; the tokens are those of an engine with every slot's pages."""
  requests = [Request(p, 6, temperature=0.8, seed=i)
              for i, p in enumerate(_prompts(256, [3, 9, 5, 7, 10, 4]))]
  small = Engine(tiny, max_slots=8, page_size=8, max_pages=6)
  assert [small.pages_for(r) for r in requests] == [2] * 6
  running = []
  for request in requests:
    small.add(request)
  tokens = {}
  while small.busy:
    for completion in small.step():
      tokens.setdefault(completion.index, completion.tokens)
    running.append(small.max_slots - small.free_slots)
  assert max(running) == 3 and small.peak_pages == 6 and small.pages_in_use == 0
  roomy = Engine(tiny, max_slots=8).run(requests)
  assert [tokens[i] for i in range(6)] == [c.tokens for c in roomy]


def test_a_long_prompt_prefills_in_chunks_while_the_others_decode(tiny):
  """Chunks of 8: a 40-token prompt takes five steps to be in, and the running request
  gets its tokens at each of them; its tokens are those of a prefill in one chunk."""
  short, long = (Request(p, 24, temperature=0) for p in _prompts(256, [3, 40]))
  engine = Engine(tiny, max_slots=2, prefill_chunk=8)
  first = engine.add(short)
  engine.step()
  second = engine.add(long)
  grown = []
  while engine.busy:
    grown.append({c.index: len(c.tokens) for c in engine.step()})
  assert [step.get(second) for step in grown[:5]] == [None] * 4 + [1 + engine.steps_per_call]
  assert all(step[first] > 0 for step in grown[:5])  # Decoding all along.
  chunked = {c.index: c for c in engine.run([short, long])}
  whole = Engine(tiny, max_slots=2).run([short, long])
  assert [chunked[i].tokens for i in (0, 1)] == [c.tokens for c in whole]
  np.testing.assert_allclose(chunked[1].logprobs, whole[1].logprobs, atol=1e-6, rtol=0)


def test_a_request_longer_than_the_pool_is_refused_by_name(tiny):
  with pytest.raises(ValueError, match=r"request 0: the prompt \(20 tokens\) and max_tokens "
                     r"\(5\) need 4 pages of 8 positions; the engine's pool holds 3 \(max_pages\)"):
    Engine(tiny, max_slots=2, page_size=8, max_pages=3).run([Request((1,) * 20, 5)])


def test_several_steps_per_call_give_the_tokens_of_one_step_per_call(tiny):
  """Four tokens per compiled call: the same tokens (greedy and seeded), requests ending
  inside a call (a stop token, max_tokens) at the same token, and the freed slot reused."""
  prompts = _prompts(256, [5, 13, 2, 9, 30])
  stop = Engine(tiny, max_slots=1).run([Request(prompts[0], 9, temperature=0)])[0].tokens[5]
  requests = [Request(prompts[0], 9, temperature=0, stop_ids=(stop,)),
              Request(prompts[1], 7, temperature=1.0, seed=3, top_p=0.9),
              Request(prompts[2], 1, temperature=0),
              Request(prompts[3], 10, temperature=0.7, seed=5, top_k=20, top_logprobs=2),
              Request(prompts[4], 6, temperature=0)]
  one = Engine(tiny, max_slots=2, steps_per_call=1).run(requests)
  four = Engine(tiny, max_slots=2, steps_per_call=4).run(requests)
  assert [c.tokens for c in four] == [c.tokens for c in one]
  assert [c.finish_reason for c in four] == [c.finish_reason for c in one]
  assert one[0].finish_reason == "stop" and len(one[0].tokens) <= 6
  assert [c.logprobs for c in four] == [c.logprobs for c in one]  # Bitwise, on CPU.
  assert [t for t, _ in four[3].top_logprobs[0]] == [t for t, _ in one[3].top_logprobs[0]]
  with pytest.raises(ValueError, match="steps_per_call=0"):
    Engine(tiny, steps_per_call=0)


def test_pools_per_replica_give_each_group_of_rows_its_own_pages(tiny):
  """Pools [K, 2, pages, P, H]: rows 0-1 read and write pool 0, rows 2-3 pool 1, with the
  same page numbers; each group as if decoded alone over a pool of its own."""
  tokens = jnp.asarray(RNG.integers(0, 256, (4, 5)), jnp.int32)
  starts, table = jnp.zeros((4,), jnp.int32), jnp.asarray([[1], [2], [1], [2]], jnp.int32)
  logits, cache = tiny.decode(tokens, KVCache(tiny.init_pages(3, 8, replicas=2), starts,
                                               table))
  assert cache.state[0]["keys"].shape == (2, 2, 3, 8, 32)  # [K, replicas, pages, page_size, H]
  for group in (0, 1):
    rows = slice(2 * group, 2 * group + 2)
    alone, own = tiny.decode(tokens[rows], KVCache(tiny.init_pages(3, 8), starts[rows],
                                                    table[rows]))
    np.testing.assert_allclose(logits[rows], alone, atol=1e-6, rtol=0)
    for name in ("keys", "values"):
      np.testing.assert_allclose(cache.state[1][name][:, group], own.state[1][name],
                                 atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="3 rows do not split into the pools' 2 replicas"):
    tiny.decode(tokens[:3], KVCache(tiny.init_pages(3, 8, replicas=2), starts[:3], table[:3]))


def test_on_a_data_parallel_mesh_the_engine_asks_for_pages_each_replica_can_hold(tiny):
  """A mesh of data 2 x fsdp 2 splits eight slots into 4 replicas, one pool each; two slots
  do not divide, and run as one replica."""
  mesh = jax.sharding.AbstractMesh((2, 2, 1, 1), MESH_AXES)
  layout = Layout.of(mesh, logical_rules(MeshConfig(rules="fsdp_tp")))
  model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0), layout=layout)
  assert (model.page_replicas(8), model.page_replicas(2), tiny.page_replicas(8)) == (4, 1, 1)
  with pytest.raises(ValueError, match="max_pages=10 must be a multiple of the mesh's 4 "
                     "data-parallel replicas"):
    Engine(model, max_slots=8, max_pages=10)


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh, replicas, paged", [
    ("qwen3", {"rules": "fsdp_tp", "data": 2, "fsdp": 2, "tensor": 2}, "('data', 'fsdp')",
     "pallas_gpu"),
    ("mixtral", {"rules": "fsdp_tp", "data": 2, "expert": 2, "tensor": 2},
     "('data', 'expert')", "xla"),
    pytest.param("gpt_oss", {"rules": "fsdp_tp", "data": 2, "expert": 2, "tensor": 2},
                 "('data', 'expert')", "xla", marks=pytest.mark.slow),  # Sinks per replica.
], ids=["qwen3 on data x fsdp x tensor, a Pallas kernel", "mixtral on data x expert x tensor",
        "gpt_oss on data x expert x tensor"])
def test_on_a_mesh_the_engine_gives_one_device_s_tokens_a_pool_per_data_parallel_replica(
    name, mesh, replicas, paged):
  """Weights split over `tensor` (and a MoE's experts over `expert`); eight slots in four
  data-parallel replicas (the batch axes), each with a pool of its own, the pools' key/value
  heads over `tensor`. Greedy and seeded sampled tokens equal one device's, nine requests
  for eight slots and 24 pages (some wait); log-probs within float32 rounding (a split
  matmul sums in another order). A device holds its replica's pages alone, and no
  collective of the decoding step moves pages (one pool split by pages, read with global
  page numbers, all-reduces every page read). The replicas prefill their slots side by
  side, in calls of a row each.

  Qwen3 decodes with JAX's Pallas GPU kernel (interpret mode here): a kernel XLA cannot
  partition runs manual over every mesh axis, its heads split over `tensor`
  (`layers.per_replica`; test_aot compiles the TPU's kernel so)."""
  from multidevice import run_on_devices

  result = run_on_devices("engine_on_mesh", REFERENCES / name, mesh, paged)
  assert result["tokens"] == result["expected"]
  assert result["logprobs"] < 1e-5
  # [kv_heads, replicas, pages + page 0, page_size, head_dim]
  assert result["cache"] == f"P('tensor', {replicas})" and result["replicas"] == 4
  assert result["shape"] == [2, 4, 7, 16, result["shape"][-1]]
  assert result["on_a_device"] == [1, 1, 7, 16, result["shape"][-1]]
  assert result["pages_moved"] == []
  assert result["pages_in_use"] == 0 and result["peak_pages"] > 6  # More than one pool's.
  # Nine one-chunk prompts: nine calls on one device. On the mesh the first eight (two slots
  # per replica, padded to 16, 32; 16, 32; 16, 64; 16, 16) take four calls, a slot per
  # replica of one padded length each, and the ninth one.
  assert result["prefill_calls_one_device"] == 9 and result["prefill_calls"] == 5


def test_an_engine_of_an_abstract_model_lowers_its_programs_at_their_largest_shapes():
  """What `recipes.aot` compiles for a chip this machine lacks: nothing allocated, and the
  decoding program holds every slot's pages (here on this CPU, for the shapes)."""
  config = DecoderConfig.tiny()
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  engine = Engine(model, max_slots=4, max_len=64, page_size=16, prefill_chunk=32)
  assert isinstance(jax.tree.leaves(engine._cache)[0], jax.ShapeDtypeStruct)
  pages = 4 * 64 // 16 + 1  # Page 0: where idle rows write.
  pool = 2 * config.num_layers * config.num_kv_heads * pages * 16 * config.resolved_head_dim * 4
  decode = engine.lower("decode").compile().memory_analysis()
  assert decode.argument_size_in_bytes > pool
  assert decode.alias_size_in_bytes == pool  # The pools are donated, updated in place.
  prefill = engine.lower("prefill").compile().memory_analysis()
  assert prefill.alias_size_in_bytes == pool


def test_a_slot_is_as_long_as_its_longest_request_in_powers_of_two_up_to_the_model():
  from jax_ai_stack.recipes.inference import slot_length

  assert slot_length([Request((1,) * 3, max_tokens=4)], 40_960) == 64  # One page at least.
  assert slot_length([Request((1,) * 60, max_tokens=5), Request((1,), max_tokens=2)],
                     40_960) == 128
  assert slot_length([Request((1,) * 200, max_tokens=57)], 40_960) == 512  # 257 -> 512.
  assert slot_length([Request((1,) * 200, max_tokens=57)], 300) == 300  # The model's end.


def test_generating_a_few_tokens_holds_pages_for_them_not_for_the_model_s_whole_context(
    engine_lengths):
  # Qwen3's 40,960 positions a slot would be 4.7 GB of keys and values at 0.6B, to write 32.
  from jax_ai_stack.recipes import config as config_lib
  from jax_ai_stack.recipes import tasks

  task = tasks.for_config(config_lib.load("lm-tiny", overrides=["model.max_seq_len=2048"]))
  text = task.generate(task.build_model(0), "def ", 6, 0.0, 0)
  assert text.startswith("def ") and engine_lengths == [64]


def test_requests_with_one_prompt_prefill_it_once_and_each_gives_what_it_gives_alone(tiny):
  """A GRPO group's members share their prompt's pages (copied from the first, which prefills
  it, running or prefilling), even one admitted after its source is decoding; each request's
  tokens and log-probabilities are bit for bit its own alone. Three prompts (5, 70 and 17
  tokens: 70 spans pages and two prefill chunks of 64) x 4 samples on 6 slots."""
  prompts = _prompts(256, [5, 70, 17])
  requests = [Request(p, 8, temperature=1.0, seed=100 * i + g, top_logprobs=2)
              for i, p in enumerate(prompts) for g in range(4)]
  engine = Engine(tiny, max_slots=6, page_size=16, prefill_chunk=64)
  shared = engine.run(requests)
  assert engine.shared_prompts >= 8  # 12 requests, 3 prompts (a fourth prefill at most).
  for request, completion in zip(requests, shared):
    alone = Engine(tiny, max_slots=6, page_size=16, prefill_chunk=64).run([request])[0]
    assert (alone.tokens, alone.logprobs, alone.top_logprobs) == (
        completion.tokens, completion.logprobs, completion.top_logprobs), request.seed
  assert len({tuple(c.tokens) for c in shared[:4]}) > 1  # Sampled, each with its seed.


def _same(a, b) -> bool:
  return (a.tokens, a.logprobs, a.top_logprobs) == (b.tokens, b.logprobs, b.top_logprobs)


def test_prompts_that_begin_alike_reuse_kept_chunks_bit_for_bit(tiny):
  """Chunks of 16 tokens, pages of 8: a 50-token prompt keeps its 3 whole chunks after it
  ends; a second prompt with its first 40 tokens reuses 2 (its third differs), one with its
  first 20 reuses 1, one with its first 10 none; the same first 48 tokens and nothing more
  reuse 2, as the last prompt token is always prefilled (its logits give the first token).
  Each request's tokens, log-probs and alternatives are those of an engine without the cache."""
  base = _prompts(256, [50])[0]
  first = Request(base, 6, temperature=1.0, seed=1, top_logprobs=2)
  others = [Request(base[:n] + tail, 6, temperature=1.0, seed=s, top_logprobs=2)
            for s, (n, tail) in enumerate([(40, (1, 2, 3)), (20, (4,) * 9), (10, (5,) * 30),
                                           (48, ())], start=2)]
  engine = Engine(tiny, max_slots=2, page_size=8, prefill_chunk=16)
  done = engine.run([first])
  assert engine.cached_pages == 6 and engine.pages_in_use == 0 and engine.prefix_hits == 0
  done += engine.run(others)
  assert engine.prefix_hits == 3 and engine.cached_tokens == 32 + 16 + 32
  plain = Engine(tiny, max_slots=2, page_size=8, prefill_chunk=16, prefix_cache=False)
  for request, completion in zip([first, *others], done):
    assert _same(completion, plain.run([request])[0]), request.seed
  assert plain.cached_pages == 0 and plain.prefix_hits == 0


def test_kept_chunks_make_room_when_the_pool_needs_it_and_never_while_held(tiny):
  """A pool of 8 pages of 8: the first request keeps 2 chunks (4 pages); one that needs 8
  pages evicts them and gives what it gives without the cache; two requests sharing a
  prefix run at once, the second reusing the first's chunk while the first prefills on."""
  long, other = _prompts(256, [40, 20])
  engine = Engine(tiny, max_slots=2, page_size=8, max_pages=8, prefill_chunk=16)
  engine.run([Request(long, 4, temperature=0)])
  assert engine.cached_pages == 4
  big = Request(other, 44, temperature=0)  # 64 positions: the whole pool.
  assert _same(engine.run([big])[0], Engine(tiny, max_slots=2, page_size=8, max_pages=8,
                                             prefill_chunk=16, prefix_cache=False).run([big])[0])
  assert engine.cached_pages == 2 and engine.prefix_hits == 0  # Only its own first chunk.
  twins = [Request(long[:20] + (n,), 8, temperature=0) for n in (1, 2)]
  engine.add(twins[0])
  engine.step()  # The first has its first chunk in (kept) and prefills the rest next.
  engine.add(twins[1])
  out, held = {}, []
  while engine.busy:
    out.update({c.index: c for c in engine.step() if c.finish_reason})
    held.append(engine.pages_in_use)
  # 4 pages each (21 + 8 positions), 2 of them shared: 6 held at most, and no kept page
  # handed out (the chunk kept by `big` stays: there was room).
  assert engine.prefix_hits == 1 and engine.cached_tokens == 16 and max(held) == 6
  assert engine.cached_pages == 4
  for index, request in zip(sorted(out)[-2:], twins):
    assert _same(out[index], Engine(tiny, max_slots=2, page_size=8, prefill_chunk=16,
                                    prefix_cache=False).run([request])[0])


def test_no_chunk_is_kept_for_a_model_with_per_slot_state_or_chunks_across_pages():
  from test_cache import counting_model  # pylint: disable=import-outside-toplevel

  prompt = tuple(range(1, 41))
  recurrent = Engine(counting_model(), max_slots=1, max_len=64, page_size=8, prefill_chunk=16)
  recurrent.run([Request(prompt, 2, temperature=0)] * 2)
  tiny = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  ragged = Engine(tiny, max_slots=1, page_size=8, prefill_chunk=12)
  ragged.run([Request(prompt, 2, temperature=0)] * 2)
  assert recurrent.cached_pages == ragged.cached_pages == 0
  assert recurrent.prefix_hits == ragged.prefix_hits == 0


def test_a_logit_bias_steers_its_own_request_alone(tiny):
  """Greedy: a request that forces token 42 (+100) gets it at every step; one that bans the
  tokens the plain request chose (-100) gets none of them; the plain request beside them
  gives, bit for bit, what it gives alone."""
  prompt = _prompts(256, [5])[0]
  plain = Request(prompt, 6, temperature=0, top_logprobs=2)
  alone = Engine(tiny, max_slots=3).run([plain])[0]
  forced = Request(prompt, 6, temperature=0, logit_bias=((42, 100.0),))
  banned = Request(prompt, 6, temperature=0,
                   logit_bias=tuple((t, -100.0) for t in sorted(set(alone.tokens))))
  out = Engine(tiny, max_slots=3).run([forced, banned, plain])
  assert out[0].tokens == [42] * 6 and not set(out[1].tokens) & set(alone.tokens)
  assert _same(out[2], alone)
  assert max(out[0].logprobs) < 0  # The model's log-probabilities, not the biased ones.
