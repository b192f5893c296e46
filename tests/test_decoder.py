"""Tests of the decoder (`models.decoder`): shapes, counts, masking, GQA, cache, remat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models import decoder, decoding
from jax_ai_stack.recipes.models.decoding import generate
from jax_ai_stack.recipes.models.decoder import (
    Decoder, DecoderConfig, KVCache, RopeScaling, apply_rope)

# Smaller than `tiny` so that every test compiles in about a second.
MICRO = dict(
    vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
    max_seq_len=32,
)


def micro(**overrides) -> DecoderConfig:
  return DecoderConfig(**{**MICRO, **overrides})


@pytest.fixture(scope="module")
def model() -> Decoder:
  """One micro model shared by the tests that only read it (saves compiles)."""
  return Decoder(micro(), rngs=nnx.Rngs(0))


def count_params(model_or_state) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model_or_state, nnx.Param)))


@nnx.jit
def forward(model, tokens, segment_ids=None, positions=None):
  return model(tokens, segment_ids=segment_ids, positions=positions)


def random_tokens(shape, vocab_size=64, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab_size, dtype=jnp.int32)


# Configs ----------------------------------------------------------------------


def test_presets_validate_and_defaults_are_tiny():
  assert DecoderConfig() == DecoderConfig.tiny()
  tiny, small = DecoderConfig.tiny(), DecoderConfig.small()
  assert (tiny.d_model, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads) == (128, 4, 4, 2)
  assert small.d_model == 384 and small.num_layers == 6
  assert DecoderConfig.small(num_layers=2).num_layers == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(d_model=30, num_heads=4), "num_heads=4 must divide d_model=30"),
        (dict(head_dim=7), "head_dim=7 must be even"),
    ],
)
def test_config_rejects_inconsistent_shapes(fields, message):
  with pytest.raises(ValueError, match=message):
    DecoderConfig(**fields)
  with pytest.raises(configlib.ConfigError, match=message):
    configlib.from_dict(DecoderConfig, fields)


def test_config_errors_name_the_field():
  with pytest.raises(configlib.ConfigError, match=r"'dtype'.*'float42'"):
    configlib.from_dict(DecoderConfig, {"dtype": "float42"})
  with pytest.raises(configlib.ConfigError, match=r"'remat'.*'some'"):
    configlib.from_dict(DecoderConfig, {"remat": "some"})
  with pytest.raises(configlib.ConfigError, match=r"'num_layers'.*greater than 0"):
    configlib.from_dict(DecoderConfig, {"num_layers": 0})
  with pytest.raises(configlib.ConfigError, match="did you mean 'num_kv_heads'"):
    configlib.from_dict(DecoderConfig, {"num_kv_head": 2})


def test_config_round_trips_through_yaml():
  config = DecoderConfig.llama3_8b(remat="save_dots", rope_scaling=RopeScaling(factor=32.0))
  loaded = configlib.from_dict(DecoderConfig, yaml.safe_load(configlib.to_yaml(config)))
  assert loaded == config and loaded.rope_scaling.factor == 32.0


def test_rope_scaling_is_validated_by_field():
  with pytest.raises(ValueError, match="high_freq_factor=1.0 must be greater than low_freq_factor=1.0"):
    RopeScaling(high_freq_factor=1.0)
  with pytest.raises(configlib.ConfigError, match=r"'rope_scaling.factor'.*greater than 0"):
    configlib.from_dict(DecoderConfig, {"rope_scaling": {"factor": 0}})
  with pytest.raises(configlib.ConfigError, match=r"'rope_scaling.kind'.*'dynamic'"):
    configlib.from_dict(DecoderConfig, {"rope_scaling": {"kind": "dynamic"}})
  with pytest.raises(configlib.ConfigError, match="did you mean 'rope_scaling.low_freq_factor'"):
    configlib.from_dict(DecoderConfig, {"rope_scaling": {"low_freq_facter": 2.0}})
  # A dotted override fills the rest with Llama 3.1's values.
  config = configlib.from_dict(DecoderConfig,
                               configlib.apply_overrides({}, ["rope_scaling.factor=32"]))
  assert config.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=8192)
  assert DecoderConfig().rope_scaling is None


# Shapes and parameter counts --------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_the_shapes(tie):
  config = micro(tie_embeddings=tie)
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  assert count_params(model) == config.num_params()
  untied_extra = 0 if not tie else config.padded_vocab_size * config.d_model
  assert micro(tie_embeddings=False).num_params() - config.num_params() == untied_extra
  assert (model.lm_head is None) == tie


@pytest.mark.parametrize("tie", [True, False])
def test_a_padded_vocabulary_keeps_its_rows_zero_and_its_logits_out(tie):
  """vocab 60 padded to 64 rows: logits [.., 60] equal an unpadded model's with the
  same weights, and a step of AdamW with weight decay leaves the padded rows zero."""
  config = micro(tie_embeddings=tie, vocab_size=60, vocab_multiple=32)
  assert config.padded_vocab_size == 64
  model = Decoder(config, rngs=nnx.Rngs(0))
  tables = [model.embed.embedding] + ([] if tie else [model.lm_head.kernel])
  assert [t.shape for t in tables] == [(64, 32)] + ([] if tie else [(32, 64)])
  padded_rows = lambda: [np.asarray(model.embed.embedding)[60:]] + (
      [] if tie else [np.asarray(model.lm_head.kernel)[:, 60:]])
  assert not any(rows.any() for rows in padded_rows())
  tokens = jnp.arange(24).reshape(2, 12) * 5 % 60
  logits = model(tokens)
  assert logits.shape == (2, 12, 60)

  unpadded = Decoder(micro(tie_embeddings=tie, vocab_size=60, vocab_multiple=1), rngs=nnx.Rngs(1))
  state = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))
  state["embed"]["embedding"].set_value(state["embed"]["embedding"].get_value()[:60])
  if not tie:
    state["lm_head"]["kernel"].set_value(state["lm_head"]["kernel"].get_value()[:, :60])
  nnx.update(unpadded, state)
  np.testing.assert_array_equal(unpadded(tokens), logits)

  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()
  for _ in range(2):
    optimizer.update(model, nnx.grad(loss)(model))
  assert not any(rows.any() for rows in padded_rows())
  assert not np.array_equal(model(tokens), logits)  # It did train.


def test_vocab_multiple_one_is_no_padding_and_a_multiple_rounds_up():
  assert micro(vocab_size=259).padded_vocab_size == 384
  assert micro(vocab_size=256).padded_vocab_size == 256
  assert micro(vocab_size=259, vocab_multiple=1).padded_vocab_size == 259
  assert DecoderConfig.llama3_8b().padded_vocab_size == 128_256


def test_tiny_and_small_param_counts_abstractly():
  for config in (DecoderConfig.tiny(), DecoderConfig.small()):
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    assert count_params(abstract) == config.num_params()


def test_llama3_8b_shapes_and_8_03b_params_abstractly():
  config = DecoderConfig.llama3_8b()
  abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
  n = sum(x.size for x in leaves)
  assert round(n / 1e9, 2) == 8.03  # Meta's published count
  assert n == config.num_params()
  attention = abstract.layers[0].attention
  assert attention.q_proj.kernel.shape == (4096, 32, 128)
  assert attention.k_proj.kernel.shape == (4096, 8, 128)
  assert attention.o_proj.kernel.shape == (32, 128, 4096)
  assert abstract.layers[0].mlp.gate_proj.kernel.shape == (4096, 14336)
  assert abstract.lm_head.kernel.shape == (4096, 128_256)


def test_forward_shape_and_float32_logits_in_both_compute_dtypes(model):
  tokens = random_tokens((2, 12))
  full = forward(model, tokens)
  assert full.shape == (2, 12, 64) and full.dtype == jnp.float32
  half_model = Decoder(micro(dtype="bfloat16"), rngs=nnx.Rngs(0))  # same float32 params
  half = forward(half_model, tokens)
  assert half.dtype == jnp.float32  # the trainer's cross-entropy needs float32
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(half_model, nnx.Param)))
  assert not np.array_equal(full, half)  # bfloat16 was really used
  np.testing.assert_allclose(half, full, atol=0.05 * float(jnp.abs(full).max()))


def test_param_dtype_sets_storage():
  model = nnx.eval_shape(lambda: Decoder(micro(param_dtype="bfloat16"), rngs=nnx.Rngs(0)))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_bad_inputs_are_named(model):
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model(jnp.zeros((2, 3, 4), jnp.int32))
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model(jnp.zeros((2, 3), jnp.float32))
  with pytest.raises(ValueError, match=r"positions must have the shape of tokens \(2, 3\)"):
    model(jnp.zeros((2, 3), jnp.int32), positions=jnp.zeros((2, 4), jnp.int32))


# Sharding annotations ----------------------------------------------------------


def test_every_param_has_logical_axis_names():
  for tie in (True, False):
    model = nnx.eval_shape(lambda: Decoder(micro(tie_embeddings=tie), rngs=nnx.Rngs(0)))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      names = var.get_metadata().get("out_sharding")
      assert names is not None and len(names) == var.ndim, path
      assert set(names) <= set(decoder.LOGICAL_AXES), (path, names)
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  assert specs["embed"]["embedding"].get_value() == P("vocab", "embed")
  assert specs["layers"][0]["attention"]["k_proj"]["kernel"].get_value() == P(
      "embed", "kv_heads", "head_dim"
  )
  assert specs["lm_head"]["kernel"].get_value() == P("embed", "vocab")


def test_params_are_sharded_at_creation_under_a_mesh():
  mesh = jax.make_mesh((1,), ("fsdp",))
  rules = [(name, "fsdp" if name == "embed" else None) for name in decoder.LOGICAL_AXES]
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = nnx.eval_shape(lambda: Decoder(micro(), rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  assert params["embed"]["embedding"].get_value().sharding.spec == P(None, "fsdp")
  assert params["layers"][0]["mlp"]["down_proj"]["kernel"].get_value().sharding.spec == P(
      None, "fsdp"
  )


# Attention semantics -----------------------------------------------------------


def test_future_tokens_do_not_change_earlier_logits(model):
  tokens = random_tokens((2, 12))
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 64)
  before, after = forward(model, tokens), forward(model, changed)
  np.testing.assert_allclose(after[:, :7], before[:, :7], atol=1e-6)
  assert not np.allclose(after[:, 7:], before[:, 7:], atol=1e-3)


def test_segments_isolate_packed_documents(model):
  doc_a, doc_b = random_tokens((1, 5), seed=1), random_tokens((1, 7), seed=2)
  packed = jnp.concatenate([doc_a, doc_b, jnp.zeros((1, 4), jnp.int32)], axis=1)
  segment_ids = jnp.array([[1] * 5 + [2] * 7 + [0] * 4], jnp.int32)
  positions = jnp.array([list(range(5)) + list(range(7)) + list(range(4))], jnp.int32)
  logits = forward(model, packed, segment_ids, positions)

  def alone(doc):  # One document, padded at the end to the same shape (one compile).
    padded = jnp.zeros((1, 16), jnp.int32).at[:, : doc.shape[1]].set(doc)
    ones, arange = jnp.ones((1, 16), jnp.int32), jnp.arange(16)[None]
    return forward(model, padded, ones, arange)[:, : doc.shape[1]]

  np.testing.assert_allclose(logits[:, :5], alone(doc_a), atol=1e-5)
  np.testing.assert_allclose(logits[:, 5:12], alone(doc_b), atol=1e-5)
  assert not np.allclose(logits[:, 5:12], alone(jnp.concatenate([doc_a, doc_b], 1))[:, 5:])


def test_positions_drive_rope_and_only_differences_matter(model):
  # (1, 16) tokens with segment ids and positions: the compile of the test above.
  tokens, one_segment = random_tokens((1, 16)), jnp.ones((1, 16), jnp.int32)
  arange = jnp.arange(16)[None]
  default = forward(model, tokens, one_segment, arange)
  shifted = forward(model, tokens, one_segment, arange + 11)
  np.testing.assert_allclose(shifted, default, atol=1e-4)
  assert not np.allclose(forward(model, tokens, one_segment, arange * 2), default, atol=1e-3)


rope = jax.jit(apply_rope, static_argnums=2)


def test_rope_depends_on_relative_position_only():
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 16))
  def score(m, n):
    rq = rope(q, jnp.array([[m]]), 10_000.0)
    rk = rope(k, jnp.array([[n]]), 10_000.0)
    return float(jnp.sum(rq * rk))
  assert score(3, 1) == pytest.approx(score(12, 10), abs=1e-5)
  assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
  rotated = rope(q, jnp.array([[5]]), 10_000.0)
  assert float(jnp.linalg.norm(rotated)) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-6)


@pytest.mark.skipif(
    not hasattr(nnx, "RoPE"),
    reason="this flax has no nnx.RoPE (0.12.8); test_rope_depends_on_relative_position_only"
    " checks apply_rope on this row",
)
def test_rope_matches_flax_rope():
  x = jax.random.normal(jax.random.key(0), (2, 9, 3, 16))  # [B, T, N, H]
  positions = jnp.broadcast_to(jnp.arange(9) + 4, (2, 9))
  ours = rope(x, positions, 500_000.0)
  flax_rope = jax.jit(lambda x, p: nnx.RoPE(theta=500_000.0)(x, p))
  theirs = flax_rope(x.transpose(0, 2, 1, 3), jnp.arange(9.0) + 4)
  np.testing.assert_allclose(ours, theirs.transpose(0, 2, 1, 3), atol=1e-5)


def llama3_inv_freq_reference(head_dim, theta, factor, low, high, old_context):
  """Meta's `apply_scaling` (llama-models, Llama 3.1), one frequency at a time, in float64."""
  out = []
  for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
    wavelen = 2 * np.pi / freq
    if wavelen < old_context / high:
      out.append(freq)
    elif wavelen > old_context / low:
      out.append(freq / factor)
    else:
      smooth = (old_context / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, old_context", [
    (128, 500_000.0, 8.0, 1.0, 4.0, 8192),   # Llama 3.1 8B
    (64, 500_000.0, 32.0, 1.0, 4.0, 8192),   # Llama 3.2 1B
    (8, 500.0, 8.0, 1.0, 4.0, 32),           # tests/test_hf.py's tiny model
    (16, 10_000.0, 4.0, 2.0, 8.0, 64),
])
def test_llama3_rope_scaling_matches_meta_reference(head_dim, theta, factor, low, high, old_context):
  scaling = RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                        original_max_position_embeddings=old_context)
  ours = np.asarray(decoder.rope_inv_freq(head_dim, theta, scaling))
  expected = llama3_inv_freq_reference(head_dim, theta, factor, low, high, old_context)
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, expected, rtol=1e-5)
  # Each case has kept, divided and blended frequencies, so every branch is checked.
  plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  kept = np.isclose(expected, plain, rtol=1e-12)
  divided = np.isclose(expected, plain / factor, rtol=1e-12)
  assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_no_rope_scaling_keeps_the_plain_rope_bitwise():
  positions = jnp.arange(40)[None] * 7
  sin, cos, _ = decoder.rope_tables(positions, 16, 500_000.0)
  # The formula before rope_scaling existed: checkpoints and resumes must not move a bit.
  inv_freq = 1.0 / 500_000.0 ** (jnp.arange(0, 8, dtype=jnp.float32) * 2 / 16)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq
  assert np.array_equal(sin, jnp.sin(angles)) and np.array_equal(cos, jnp.cos(angles))


def test_the_model_applies_its_rope_scaling(model):
  scaled = Decoder(micro(rope_scaling=RopeScaling(original_max_position_embeddings=8)),
                 rngs=nnx.Rngs(0))  # The same parameters as `model`.
  tokens = random_tokens((1, 16))
  plain, stretched = forward(model, tokens), forward(scaled, tokens)
  np.testing.assert_allclose(stretched[:, :1], plain[:, :1], atol=1e-6)  # Position 0: no angle.
  assert not np.allclose(stretched[:, 1:], plain[:, 1:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_weights(model):
  gqa = model
  assert gqa.config.num_kv_heads == 2 and gqa.config.num_heads == 4
  # Every parameter is copied below, so the MHA model need not be initialised.
  mha = nnx.eval_shape(lambda: Decoder(micro(num_kv_heads=4), rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
  for layer in params["layers"].values():
    for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j + 1
      kernel = layer["attention"][name]["kernel"]
      layer["attention"][name]["kernel"] = jnp.repeat(kernel, 2, axis=1)
  mha_state = nnx.state(mha, nnx.Param)
  nnx.replace_by_pure_dict(mha_state, params)
  nnx.update(mha, mha_state)
  tokens = random_tokens((2, 12))
  np.testing.assert_allclose(forward(mha, tokens), forward(gqa, tokens), atol=1e-5)


# KV cache and generation --------------------------------------------------------


def test_cached_decoding_gives_the_full_forward_logits(model):
  tokens = random_tokens((2, 11))
  full = forward(model, tokens)
  decode = nnx.jit(lambda model, tokens, cache: model.decode(tokens, cache))
  cache = model.init_cache(batch_size=2, max_length=16)
  logits, cache = decode(model, tokens[:, :5], cache)  # prefill
  steps = [logits]
  for t in range(5, 11):
    logits, cache = decode(model, tokens[:, t : t + 1], cache)
    steps.append(logits)
  assert isinstance(cache, KVCache) and int(cache.length) == 11
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)

def test_a_prefill_with_logits_at_gives_each_row_s_chosen_token_s_logits_alone(model):
  """The head runs on one token a row (what a prefill samples from); the same logits as the
  whole prefill's at those tokens, and the same cache."""
  tokens = random_tokens((2, 7))
  decode = nnx.jit(lambda model, tokens, cache, at: model.decode(tokens, cache, logits_at=at))
  cache = model.init_cache(batch_size=2, max_length=16)
  every, every_cache = decode(model, tokens, cache, None)
  chosen, chosen_cache = decode(model, tokens, cache, jnp.asarray([6, 2], jnp.int32))
  assert chosen.shape == (2, 1, every.shape[-1])
  np.testing.assert_allclose(chosen[:, 0], every[jnp.arange(2), jnp.asarray([6, 2])],
                             atol=1e-6)
  np.testing.assert_array_equal(chosen_cache.state[0]["keys"], every_cache.state[0]["keys"])



def test_a_length_per_row_without_a_block_table_is_refused(model):
  cache = model.init_cache(batch_size=2, max_length=16)._replace(length=jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="one length per row is a paged one: give its block_table"):
    model.decode(random_tokens((2, 1)), cache)


def test_greedy_generate_matches_recomputing_the_whole_sequence(model):
  prompt = random_tokens((2, 4))
  out = generate(model, prompt, 8, temperature=0.0, rng=jax.random.key(0))
  assert out.shape == (2, 12) and out.dtype == jnp.int32
  # Causal, so a zero-padded buffer of the final length gives the same logits
  # at every filled position: one shape, one compile.
  expected = jnp.zeros((2, 12), jnp.int32).at[:, :4].set(prompt)
  for t in range(4, 12):
    next_token = jnp.argmax(forward(model, expected)[:, t - 1], axis=-1)
    expected = expected.at[:, t].set(next_token)
  np.testing.assert_array_equal(out, expected)


def test_sampling_is_seeded_top_k_1_is_greedy_and_compiles_once(model):
  prompt = random_tokens((2, 4))
  sample = lambda seed, **kw: generate(model, prompt, 8, rng=jax.random.key(seed), **kw)
  compiled_before = decoding._generate._cache_size()
  first = sample(0, temperature=1.0)
  np.testing.assert_array_equal(first[:, :4], prompt)
  assert int(first.min()) >= 0 and int(first.max()) < 64
  np.testing.assert_array_equal(sample(0, temperature=1.0), first)
  assert not np.array_equal(sample(1, temperature=1.0), first)
  greedy = sample(0, temperature=0.0)
  assert not np.array_equal(first, greedy)
  np.testing.assert_array_equal(sample(2, temperature=1e-4), greedy)  # cold: near greedy
  # rng and temperature are traced: at most one compile for all these calls
  # (none if another model of the same structure compiled it already).
  assert decoding._generate._cache_size() - compiled_before <= 1
  np.testing.assert_array_equal(sample(3, temperature=1.5, top_k=1), greedy)


def test_generate_compiles_once_for_any_number_of_new_tokens(model):
  prompt = random_tokens((1, 4))
  greedy = lambda n: generate(model, prompt, n, temperature=0.0, rng=jax.random.key(0))
  longest = greedy(20)
  compiled_before = decoding._generate._cache_size()
  for n in (1, 5, 13):  # The cache is always max_seq_len long; the count is traced.
    np.testing.assert_array_equal(greedy(n), longest[:, :4 + n])
  assert decoding._generate._cache_size() == compiled_before


def test_top_p_keeps_the_likeliest_tokens_whose_mass_reaches_p(model):
  prompt = random_tokens((2, 4))
  sample = lambda seed, **kw: generate(model, prompt, 8, rng=jax.random.key(seed), **kw)
  greedy = sample(0, temperature=0.0)
  np.testing.assert_array_equal(sample(5, temperature=2.0, top_p=1e-6), greedy)  # One token.
  wide = [sample(seed, temperature=2.0, top_p=1.0) for seed in range(3)]
  assert any(not np.array_equal(w, greedy) for w in wide)
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  drawn = {int(decoding._sample(logits, jax.random.key(i), jnp.float32(1.0), None, 0.7)[0])
           for i in range(200)}
  assert drawn == {0, 1}  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it.


@pytest.mark.parametrize(
    "prompt_shape, kwargs, message",
    [
        ((2, 4), dict(max_new_tokens=40), "exceeds max_seq_len=32"),
        ((2, 4), dict(max_new_tokens=2, top_k=0), r"top_k must be in \[1, vocab_size=64\]"),
        ((2, 4), dict(max_new_tokens=2, temperature=-1.0), "temperature must be >= 0"),
        ((2, 4), dict(max_new_tokens=2, top_p=0.0), r"top_p must be in \(0, 1\]"),
        ((2, 4), dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
        ((4,), dict(max_new_tokens=2), "tokens must be an int array"),
        ((2, 0), dict(max_new_tokens=2), "at least one token"),
    ],
)
def test_generate_rejects_bad_arguments(model, prompt_shape, kwargs, message):
  with pytest.raises(ValueError, match=message):
    generate(model, jnp.zeros(prompt_shape, jnp.int32), rng=jax.random.key(0), **kwargs)


def test_generate_zero_new_tokens_returns_the_prompt(model):
  prompt = random_tokens((1, 3))
  np.testing.assert_array_equal(generate(model, prompt, 0, rng=jax.random.key(0)), prompt)


# Remat and FLOPs --------------------------------------------------------------


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_remat_gives_the_same_gradients():
  tokens = random_tokens((2, 12))
  grad_fn = nnx.jit(nnx.grad(loss_fn))

  def jaxpr_text(model):
    graphdef, state = nnx.split(model)
    return str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))

  plain = Decoder(micro(num_layers=1), rngs=nnx.Rngs(0))
  expected = nnx.to_pure_dict(grad_fn(plain, tokens))
  plain_text = jaxpr_text(plain)
  assert "remat" not in plain_text and "checkpoint" not in plain_text
  for policy in ("full", "save_dots"):
    remat = Decoder(micro(num_layers=1, remat=policy), rngs=nnx.Rngs(0))
    got = nnx.to_pure_dict(grad_fn(remat, tokens))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, expected
    )
    remat_text = jaxpr_text(remat)  # the recomputation is really in the program
    assert "remat" in remat_text or "checkpoint" in remat_text, policy


def test_flops_per_token_agrees_with_xla_cost_analysis():
  config = micro(d_model=64, mlp_dim=256, vocab_size=512, tie_embeddings=False)
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))  # lowering needs shapes only
  graphdef, state = nnx.split(model)
  batch, seq = 2, 32
  lowered = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(
      state, jnp.zeros((batch, seq), jnp.int32)
  )
  analysis = lowered.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  forward_flops = config.flops_per_token(seq) / 3 * batch * seq  # fwd is 1/3 of fwd + bwd
  # XLA also counts norms, softmax and activations; matmuls dominate.
  assert analysis["flops"] == pytest.approx(forward_flops, rel=0.05)


def test_a_layout_pins_activations_only_under_a_mesh_of_several_devices():
  """On 8 devices (data 2 x fsdp 2 x tensor 2) a model given the placement's
  layout has the one-device logits (max difference / max |logit| <= 2e-5, the
  tolerance of test_sharding.py: sharded matmuls sum in another order), one
  constraint after the embedding and two per block, and decodes a single
  prompt (a batch that does not divide) greedily to the same tokens. Its copy on one device
  (`sharding.on_one_device`) pins nothing and computes the plain model's logits bit for bit."""
  from jax_ai_stack.recipes import sharding
  from multidevice import run_on_devices

  assert sharding.Placement.build(sharding.MeshConfig(), {}).layout() is None  # One device.
  result = run_on_devices("decoder_layout_on_mesh", MICRO)
  # The embedding table (whole for the lookup) and the rows it gives; per block, the
  # attention and MLP outputs.
  assert result["constraints"] == 2 + 2 * MICRO["num_layers"]
  assert result["plain_constraints"] == result["one_device_constraints"] == 0
  assert result["one_device_same"]
  assert result["error"] <= 2e-5
  assert result["generated"] == result["expected"]


def test_the_decoders_first_names_still_import_with_a_deprecation_warning():
  from jax_ai_stack.recipes import models
  with pytest.warns(DeprecationWarning, match="models.llama.Llama is deprecated: use .*Decoder"):
    from jax_ai_stack.recipes.models.llama import Llama  # pylint: disable=g-import-not-at-top
  with pytest.warns(DeprecationWarning, match="LlamaConfig is deprecated: use .*DecoderConfig"):
    config_class = models.llama.LlamaConfig
  assert (Llama, config_class) == (Decoder, DecoderConfig)
  assert "Llama" not in models.__all__
