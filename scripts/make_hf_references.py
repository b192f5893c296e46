"""Writes transformers' reference outputs that tests/test_families.py compares with.

For each decoder family, a tiny random model whose config turns on every switch
the family has (biases, q/k norms, soft caps, a sliding window shorter than the
sequence, local and global layers, an explicit head_dim, linear RoPE scaling,
experts with and without renormalised router weights, a dense layer among sparse ones,
a gated shared expert, attention sinks, YaRN with a ramp inside the head, a SwiGLU clamp
the activations reach, chunks shorter than the sequence, a NoPE layer's temperature,
latent attention with a queries' latent and interleaved RoPE, group-limited sigmoid routing
with a correction bias, YaRN's mscale, gated DeltaNet layers between gated attention),
saved as transformers saves it, plus its float32 logits on fixed tokens and its
greedy continuation of a prompt:

  tests/references/hf/<name>/config.json, model.safetensors   (save_pretrained)
  tests/references/hf/<name>/reference.npz                    tokens, logits, prompt, greedy

Needs torch and transformers, which CI does not install: CI compares against
the committed files. Run it again after changing a config here:

  python -m venv /tmp/refenv && /tmp/refenv/bin/pip install transformers==5.24.0 safetensors \
      torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
  /tmp/refenv/bin/python scripts/make_hf_references.py [NAME ...]

Not in a venv with this package's dev extras: they pin lm-eval's transformers 5.12.1, which
computes GPT-OSS (no swiglu_limit) and OLMo 3 (one RoPE for every layer) otherwise; the script
refuses any transformers but the one `TRANSFORMERS` names.

Written with transformers 5.24.0 and torch 2.13.0 (CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np
import torch
import transformers

TRANSFORMERS = "5.24.0"
"""The transformers every reference is written with (versions.json says so)."""
OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "references" / "hf"
SEQ_LEN = 24
"""Longer than every sliding window below, so the windows change the logits."""
PROMPT_LEN, NEW_TOKENS = 5, 8

_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

_TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
"""Within the tiny vocabulary (SmolLM3's and Phi-3's defaults are not)."""

CONFIGS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        rope_theta=10_000.0, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_hidden_layers=2, head_dim=12, rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        num_hidden_layers=2, head_dim=12, sliding_window=7, tie_word_embeddings=False)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=4, head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=7, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=7,
        tie_word_embeddings=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, head_dim=12, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False,
        tie_word_embeddings=True)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(
        num_hidden_layers=2, rope_theta=500_000.0, tie_word_embeddings=False)),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, dict(
        num_hidden_layers=4, sliding_window=6, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 500_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1], use_sliding_window=True,
        sliding_window=6, rope_theta=2_000_000.0, tie_word_embeddings=True, **_TOKEN_IDS)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        num_hidden_layers=2, sliding_window=7, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.75,  # Phi-4-mini's: 6 of 8 features turn.
                         "short_factor": [1.0, 1.7, 3.4], "long_factor": [1.2, 5.0, 9.0]},
        tie_word_embeddings=False, **_TOKEN_IDS)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=True,
        use_sliding_window=True, sliding_window=6, max_window_layers=2,
        tie_word_embeddings=False)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        num_hidden_layers=2, head_dim=16, sliding_window=6, num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=0.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096})),
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=24, intermediate_size_mlp=64,
        interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=1,
        no_rope_layers=[1, 1, 0, 1], attention_chunk_size=5, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}, **_TOKEN_IDS)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=2,
        num_nextn_predict_layers=0, rope_interleave=True, rope_theta=10_000.0,
        tie_word_embeddings=False, **_TOKEN_IDS)),  # Dense layers (written before its MoE).
    "deepseek_v3-moe": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=2, routed_scaling_factor=2.5,
        max_position_embeddings=32, num_nextn_predict_layers=0, rope_interleave=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "mscale": 0.7, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 8}, **_TOKEN_IDS)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[2], norm_topk_prob=True,
        tie_word_embeddings=False, **_TOKEN_IDS)),
    "olmo3-yarn": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, dict(  # Long context.
        num_hidden_layers=4, sliding_window=6, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0,
                                            "rope_theta": 500_000.0,
                                            "original_max_position_embeddings": 8},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


SEEDS = {"qwen2": 0, "qwen3": 1, "mistral": 2, "gemma2": 3, "gemma3": 4, "gemma3-conditional": 5,
         "mixtral": 6, "qwen3_moe": 7, "olmo2": 8, "olmo3": 9, "smollm3": 10, "phi3": 11,
         "qwen2_moe": 8, "gpt_oss": 9, "olmo3-yarn": 14, "llama4": 15, "deepseek_v3": 16,
         "deepseek_v3-moe": 17, "qwen3_next": 18}
"""Every reference and its seed, fixed once written (two families added side by side took
the same next seeds; a seed need not be unique, only kept)."""
ORDER = list(SEEDS)


def _perturbed(model: torch.nn.Module, seed: int) -> None:
  """Every parameter moved off its init (norms of ones or zeros, biases of zeros), so
  that each switch shows in the logits."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for _, param in sorted(model.named_parameters()):
      param.add_(0.2 * torch.randn(param.shape, generator=generator))
    for name, buffer in sorted(model.named_buffers()):  # DeepSeek's choice-only router bias.
      if name.endswith("e_score_correction_bias"):
        buffer.add_(0.2 * torch.randn(buffer.shape, generator=generator))


def _gemma3_conditional(text_config: dict):
  """A Gemma3ForConditionalGeneration with a tiny vision tower (ignored when reading text)."""
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14)
  config = transformers.Gemma3Config(text_config=text_config, vision_config=vision,
                                     mm_tokens_per_image=4)
  return config, transformers.Gemma3ForConditionalGeneration


def write(name: str, config, model_class, seed: int) -> None:
  torch.manual_seed(seed)
  model = model_class(config).eval()
  _perturbed(model, seed)
  directory = OUT / name
  shutil.rmtree(directory, ignore_errors=True)
  model.save_pretrained(directory, safe_serialization=True)
  rng = np.random.default_rng(seed)
  vocab = config.get_text_config().vocab_size
  tokens = rng.integers(0, vocab, (2, SEQ_LEN), dtype=np.int64)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens)).logits.float().numpy()
    prompt = torch.from_numpy(tokens[:1, :PROMPT_LEN])
    greedy = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                            min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
  np.savez(directory / "reference.npz", tokens=tokens.astype(np.int32), logits=logits,
           prompt=tokens[:1, :PROMPT_LEN].astype(np.int32), greedy=greedy.numpy().astype(np.int32))
  for extra in ("generation_config.json",):
    (directory / extra).unlink(missing_ok=True)
  size = sum(p.stat().st_size for p in directory.iterdir())
  print(f"{name}: {model_class.__name__}, {size / 1024:.0f} KiB, "
        f"layer_types={getattr(config.get_text_config(), 'layer_types', None)}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="families to write (default: all)")
  args = parser.parse_args()
  if transformers.__version__ != TRANSFORMERS:
    raise SystemExit(f"transformers {transformers.__version__} is installed; the references are "
                     f"written with {TRANSFORMERS} (see the module's docstring)")
  wanted = args.names or ORDER
  for name, seed in SEEDS.items():
    if name not in wanted:
      continue
    if name == "gemma3-conditional":
      config_class, _, fields = CONFIGS["gemma3"]
      config, model_class = _gemma3_conditional(config_class(**_SHAPE, **fields).to_dict())
    else:
      config_class, model_class, fields = CONFIGS[name]
      config = config_class(**{**_SHAPE, **fields})
    write(name, config, model_class, seed)
  versions = {"transformers": transformers.__version__, "torch": torch.__version__}
  (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
  main()
