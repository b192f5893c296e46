"""What a `Decoder` keeps for the backward pass: bytes per row, by remat, kernel and sharding.

Example:
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> config = DecoderConfig.tiny()
  >>> flash = activation_bytes(config, 128, {}, "cudnn")
  >>> activation_bytes(config, 128, {}, "xla") > flash  # It keeps the T x T scores.
  True
  >>> activation_bytes(config, 128, {"heads": 2, "kv_heads": 2, "mlp": 2}, "cudnn") < flash
  True
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.head import LOGPS_CHUNK_TOKENS

MATERIALIZING_ATTENTION = frozenset({"xla", "tokamax_xla", "tokamax_xla_chunked"})
"""Attention kernels that keep every head's T x T scores for the backward pass.

The others (cuDNN, tokamax's Triton and Mosaic kernels, Pallas flash and
splash) are flash kernels: they keep the output and a log-sum-exp per query.
"""


def activation_bytes(model: DecoderConfig, seq_len: int, ways: Mapping[str, int],
                     attention: str, *, fused: bool = False) -> int:
  """Bytes one row of `seq_len` tokens keeps for the backward pass, on one device.

  Per token and block, in the compute dtype (`model.dtype`): the residual
  stream and the norms (6 x d_model: block input, the two norms' inputs and
  outputs, the residual after attention), q, k and v after RoPE and the
  attention output ((2 x heads + 2 x kv_heads) x head_dim), and the SwiGLU
  MLP's gate, up, sigmoid(gate), silu(gate) and product (5 x mlp_dim). Gemma's
  post-norms keep their inputs too (2 x d_model), and q/k norms (Qwen3, Gemma 3)
  theirs ((heads + kv_heads) x head_dim); without pre-norms (OLMo 2/3) there are no
  pre-norm outputs (2 x d_model fewer). A
  materializing kernel (`MATERIALIZING_ATTENTION`) adds each head's float32
  scores and probabilities over the T keys, and the boolean segment mask (T
  bytes); a flash kernel keeps a float32 log-sum-exp per head instead. After
  the blocks: the final norm (2 x d_model) per token, and the float32 logits
  with their gradient (8 bytes x vocab) of one chunk of the head's positions
  (`head.LOGPS_CHUNK_TOKENS`): the head makes them a chunk at a time and drops
  them, so a row of 8,192 tokens holds 256 positions' logits, not 8,192's.

  `model.remat` keeps less: "full" keeps each block's input and recomputes
  one block at a time in the backward pass; "save_dots" keeps the outputs of
  the weight matmuls (q, k, v, the attention's output projection, gate, up,
  down) and the block input, and recomputes the rest, one block at a time.

  Sharding: heads, kv_heads, mlp and vocab dimensions are divided by the
  mesh axes the rules map them to (`ways`, e.g. `tensor` under `fsdp_tp`);
  the residual stream is replicated over `tensor` (no sequence parallelism).
  On CPU, XLA's compiled train step of a 2-layer lm-tiny on 8 devices
  measures within 15% of this plus the gradients and gathered weights, under
  each rule set (tests/test_memory.py). The remat variants cannot be checked
  there: XLA's CPU scheduler recomputes early and keeps as much as without.

  `fused`: what XLA keeps on a TPU or GPU, which fuses elementwise ops into the backward
  pass's kernels and keeps their inputs: of the residual stream, the two norms' inputs
  (2 x d_model, not 6), and of the MLP, gate and up (2 x mlp_dim, not 5). Read from the
  buffers live at the peak of lm-tiny-grpo's step on v5e:2x2 (XLA:TPU's memory-space
  assignment dump) and on h100:8 (XLA:GPU's buffer assignment): per block and token,
  gate and up, the norms' inputs, q, k, v and the scores, and no SwiGLU product.
  """
  a, t = np.dtype(model.dtype).itemsize, seq_len
  d, h = model.d_model, model.resolved_head_dim
  share = lambda size, name: size // ways.get(name, 1)  # noqa: E731 - this device's part.
  heads, kv_heads = share(model.num_heads, "heads"), share(model.num_kv_heads, "kv_heads")
  mlp, vocab = share(model.mlp_dim, "mlp"), share(model.vocab_size, "vocab")
  if attention in MATERIALIZING_ATTENTION:
    scores = 2 * 4 * heads * t + t
  else:
    scores = 4 * heads
  norms = (2 * d if model.post_norms else 0) - (0 if model.pre_norms else 2 * d) + (
      (heads + kv_heads) * h if model.qk_norm else 0)
  residual, swiglu = (2, 2) if fused else (6, 5)
  block = a * (residual * d + norms + (2 * heads + 2 * kv_heads) * h + swiglu * mlp) + scores
  if model.remat == "full":
    kept = model.num_layers * a * d + block
  elif model.remat == "save_dots":
    kept = model.num_layers * a * (3 * d + (heads + 2 * kv_heads) * h + 2 * mlp) + block
  else:
    kept = model.num_layers * block
  return t * (kept + 2 * a * d) + min(t, LOGPS_CHUNK_TOKENS) * 8 * vocab
