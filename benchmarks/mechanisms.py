"""What each 2026 attention mechanism costs: its decoder's training step against the plain one.

The same width, depth and batch, the MLPs dense, the attention each family's:

  plain     grouped-query attention (Llama's block: the baseline)
  sinks     GPT-OSS's, a learned sink logit per head (with its q/k/v/o biases)
  latent    DeepSeek-V3's multi-head latent attention (keys and values from a latent)
  linear    Qwen3-Next's gated DeltaNet in every layer (the delta rule, chunked)

Each is timed forward+backward (the gradient of the loss, jitted), interleaved in rounds,
and reported as a ratio to plain (informational: no target; the figures are written).
Beside them, what decoding keeps a sequence per layer: bytes a token for plain (keys and
values) and latent (the latent and the shared RoPE key), and for linear a fixed state per
sequence, with the number of tokens of plain's cache it equals. Then the delta rule itself,
token by token (`gated_delta_rule`, the reference) against the chunked form the layer runs
(**target: the chunks at least 2x faster** at T 1024).

    python benchmarks/mechanisms.py                  # d_model 256, 2 layers, B2 T1024, f32
    python benchmarks/mechanisms.py --quick          # a tiny shape: a smoke test
"""

from __future__ import annotations

import argparse
import sys

import common

TARGET_CHUNKED_SPEEDUP = 2.0
"""The chunked delta rule's forward+backward at least this many times faster than the scan."""


def _configs(d_model: int, layers: int, seq_len: int):
  """{variant: DecoderConfig}, each at the same width; every MLP dense."""
  from jax_ai_stack.recipes.models.configs import (DecoderConfig, LatentAttentionConfig,
                                                   LinearAttentionConfig, MoeConfig)

  heads, head_dim = 4, d_model // 4
  dense = MoeConfig(num_experts=2, num_experts_per_tok=1, dense_layers=tuple(range(layers)))
  shape = dict(d_model=d_model, num_layers=layers, num_heads=heads, num_kv_heads=2,
               head_dim=head_dim, mlp_dim=3 * d_model, max_seq_len=seq_len, scan_layers=False)
  rope = head_dim // 4
  return {
      "plain": DecoderConfig(**shape),
      "sinks": DecoderConfig(kind="gpt_oss", **shape, moe=dense),
      "latent": DecoderConfig(kind="deepseek_v3", **{**shape, "num_kv_heads": heads}, moe=dense,
                              latent_attention=LatentAttentionConfig(
                                  kv_lora_rank=2 * head_dim, q_lora_rank=None,
                                  qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope,
                                  v_head_dim=head_dim)),
      "linear": DecoderConfig(kind="qwen3_next", **shape, moe=dense,
                              layer_types=("linear",) * layers, rotary_dim=rope,
                              linear_attention=LinearAttentionConfig(
                                  num_key_heads=2, num_value_heads=heads, key_head_dim=head_dim,
                                  value_head_dim=head_dim)),
  }


def _cache_bytes(config) -> dict[str, int]:
  """Per layer: bytes a token (paged arrays) and bytes a sequence (per-slot arrays)."""
  from flax import nnx

  from jax_ai_stack.recipes.models.decoder import Decoder

  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  spec = model.cache_specs()[0]
  sizes = {"pages": 1, "page_size": 1, "slots": 1, "length": 1}
  return {"per_token": sum(a.bytes(sizes) for a in spec.values() if not a.per_slot),
          "per_sequence": sum(a.bytes(sizes) for a in spec.values() if a.per_slot)}


def _step_ms(configs, batch: int, seq_len: int, rounds: int) -> dict[str, float]:
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from jax_ai_stack.recipes.models.decoder import Decoder

  tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, 259)
  calls = {}
  for name, config in configs.items():
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params, graphdef=graphdef):
      logits = nnx.merge(graphdef, params)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    step = jax.jit(jax.grad(loss))
    jax.block_until_ready(step(params))  # Compiled before the clock starts.
    calls[name] = lambda step=step, params=params: step(params)
  del jnp
  times = common.interleaved_ms(calls, rounds)
  return {name: min(ms) for name, ms in times.items()}


def _delta_rule_ms(batch: int, seq_len: int, heads: int, dim: int, rounds: int):
  import jax
  import jax.numpy as jnp

  from jax_ai_stack.recipes.models import linear_attention

  keys = jax.random.split(jax.random.key(1), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q = unit(jax.random.normal(keys[0], (batch, seq_len, heads, dim))) * dim ** -0.5
  k = unit(jax.random.normal(keys[1], (batch, seq_len, heads, dim)))
  v = jax.random.normal(keys[2], (batch, seq_len, heads, dim))
  g = -jax.nn.softplus(jax.random.normal(keys[3], (batch, seq_len, heads)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq_len, heads)))
  state = jnp.zeros((batch, heads, dim, dim))
  calls = {}
  for name, rule in (("token_scan", linear_attention.gated_delta_rule),
                     ("chunked", linear_attention.chunked_gated_delta_rule)):
    grad = jax.jit(jax.grad(lambda q, k, v, rule=rule: rule(q, k, v, g, beta, state)[0].sum(),
                            argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, k, v))
    calls[name] = lambda grad=grad: grad(q, k, v)
  return {name: min(ms) for name, ms in common.interleaved_ms(calls, rounds).items()}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--d-model", type=common.positive_int, default=256)
  parser.add_argument("--layers", type=common.positive_int, default=2)
  parser.add_argument("--batch", type=common.positive_int, default=2)
  parser.add_argument("--seq-len", type=common.positive_int, default=1024)
  parser.add_argument("--rounds", type=common.positive_int, default=3)
  parser.add_argument("--quick", action="store_true", help="a tiny shape, one round")
  common.add_out_argument(parser, "mechanisms")
  args = parser.parse_args(argv)
  if args.quick:
    args.d_model, args.layers, args.batch, args.seq_len, args.rounds = 64, 1, 1, 128, 1
  configs = _configs(args.d_model, args.layers, args.seq_len)
  steps = _step_ms(configs, args.batch, args.seq_len, args.rounds)
  cache = {name: _cache_bytes(config) for name, config in configs.items()}
  plain_token = cache["plain"]["per_token"]
  cache["linear"]["plain_tokens_equal"] = cache["linear"]["per_sequence"] / plain_token
  rule = _delta_rule_ms(args.batch, args.seq_len, 4, args.d_model // 4, args.rounds)
  speedup = rule["token_scan"] / rule["chunked"]
  results = {
      **common.header("mechanisms"),
      "shape": {"d_model": args.d_model, "layers": args.layers, "batch": args.batch,
                "seq_len": args.seq_len},
      "rounds": args.rounds,
      "step_ms": steps,
      "step_vs_plain": {name: ms / steps["plain"] for name, ms in steps.items()},
      "cache_bytes_per_layer": cache,
      "delta_rule_ms": rule,
      "targets": {"chunked_speedup": common.target(speedup, TARGET_CHUNKED_SPEEDUP,
                                                   at_least=True)},
  }
  print(f"train step (forward+backward) on {results['device']}: d_model {args.d_model}, "
        f"{args.layers} layers, B{args.batch} T{args.seq_len}")
  print(f"{'mechanism':<10}{'ms':>10}{'x plain':>9}{'cache/token':>13}{'cache/sequence':>16}")
  for name, ms in steps.items():
    print(f"{name:<10}{ms:>10.1f}{ms / steps['plain']:>9.2f}{cache[name]['per_token']:>13,}"
          f"{cache[name]['per_sequence']:>16,}")
  print(f"linear's state equals plain's cache of {cache['linear']['plain_tokens_equal']:.0f} "
        "tokens a layer")
  print(f"delta rule forward+backward: token scan {rule['token_scan']:.1f} ms, chunked "
        f"{rule['chunked']:.1f} ms: {speedup:.2f}x (target >= {TARGET_CHUNKED_SPEEDUP:g}x: "
        f"{common.verdict(speedup, TARGET_CHUNKED_SPEEDUP, at_least=True)})")
  common.write(results, args.out)
  return results


if __name__ == "__main__":
  main()
  sys.exit(0)
