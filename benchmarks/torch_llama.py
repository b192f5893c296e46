"""The recipe's Llama and AdamW written in PyTorch, for benchmarks/train_step.py --torch.

The same model as `jax_ai_stack.recipes.models.decoder` term for term: token
embedding, pre-norm blocks of RMSNorm -> grouped-query attention with RoPE
("rotate half", angles in float32) -> residual, RMSNorm -> SwiGLU MLP ->
residual, a final RMSNorm and the head (the embedding transposed when tied).
Attention is `F.scaled_dot_product_attention(..., is_causal=True)`. It starts
from the JAX model's parameters (copied), so both compute the same loss on the
same batch: `same_loss` checks it. The optimizer is the recipe's
`OptimConfig()`: clip by global norm, AdamW (eps outside the square root,
decoupled weight decay masked off norms and the embedding), warmup + cosine
schedule of the optimizer step, which `torch.optim.AdamW` + `LambdaLR` compute
with the same formulas.

Variants: eager or `torch.compile` (the model; the optimizer runs eagerly in
both), float32 or bfloat16 autocast (`torch.autocast("cpu")`, parameters
float32, as JAX's `model.dtype=bfloat16` with `param_dtype=float32`), on the
CPU or (`device="cuda"`, for benchmarks/accelerator.py) on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.scale = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return (normed * self.scale).to(x.dtype)


def rope(x, positions, theta: float):
  """x [B, T, N, H], positions [T]: rotates pairs (i, i + H/2), angles in float32."""
  half = x.shape[-1] // 2
  arange = torch.arange(0, half, dtype=torch.float32, device=x.device)
  inv_freq = 1.0 / theta ** (arange * 2 / x.shape[-1])
  angles = positions.float()[:, None, None] * inv_freq  # [T, 1, H/2]
  sin, cos = torch.sin(angles), torch.cos(angles)
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):

  def __init__(self, c):
    super().__init__()
    d, n, k, h = c.d_model, c.num_heads, c.num_kv_heads, c.resolved_head_dim
    self.n, self.k, self.h, self.theta = n, k, h, c.rope_theta
    self.q = nn.Linear(d, n * h, bias=False)
    self.k_proj = nn.Linear(d, k * h, bias=False)
    self.v_proj = nn.Linear(d, k * h, bias=False)
    self.o = nn.Linear(n * h, d, bias=False)

  def forward(self, x, positions):
    b, t, _ = x.shape
    q = rope(self.q(x).view(b, t, self.n, self.h), positions, self.theta)
    k = rope(self.k_proj(x).view(b, t, self.k, self.h), positions, self.theta)
    v = self.v_proj(x).view(b, t, self.k, self.h)
    out = core_attention(q, k, v)
    return self.o(out.reshape(b, t, self.n * self.h))


def core_attention(q, k, v):
  """Causal grouped-query attention; [B, T, N, H] in and out, as the JAX kernels."""
  q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # SDPA wants [B, N, T, H].
  repeats = q.shape[1] // k.shape[1]
  if repeats > 1:  # Query head i reads key/value head i // repeats.
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
  return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class MLP(nn.Module):

  def __init__(self, c):
    super().__init__()
    self.gate = nn.Linear(c.d_model, c.mlp_dim, bias=False)
    self.up = nn.Linear(c.d_model, c.mlp_dim, bias=False)
    self.down = nn.Linear(c.mlp_dim, c.d_model, bias=False)

  def forward(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):

  def __init__(self, c):
    super().__init__()
    self.attention_norm = RMSNorm(c.d_model, c.norm_eps)
    self.attention = Attention(c)
    self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
    self.mlp = MLP(c)

  def forward(self, x, positions):
    x = x + self.attention(self.attention_norm(x), positions)
    return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):

  def __init__(self, c):
    super().__init__()
    # The recipe's rows: padded to a multiple of model.vocab_multiple, the padded logits dropped.
    self.embed = nn.Embedding(c.padded_vocab_size, c.d_model)
    self.vocab_size = c.vocab_size
    self.layers = nn.ModuleList([Block(c) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.d_model, c.norm_eps)
    self.lm_head = (None if c.tie_embeddings
                    else nn.Linear(c.d_model, c.padded_vocab_size, bias=False))

  def forward(self, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = self.embed(tokens)
    for block in self.layers:
      x = block(x, positions)
    x = self.final_norm(x)
    logits = x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)
    return logits[..., :self.vocab_size].float()


def lm_loss(model, inputs, targets):
  logits = model(inputs)
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_jax_params(model: Decoder, params: dict[str, np.ndarray], config) -> None:
  """Copies the JAX model's parameters ({'a/b/c': array}) into `model`."""
  d, n, k, h = config.d_model, config.num_heads, config.num_kv_heads, config.resolved_head_dim

  def put(param, value):
    with torch.no_grad():
      param.copy_(torch.from_numpy(np.array(value, np.float32)))  # A writable copy.

  put(model.embed.weight, params["embed/embedding"])
  put(model.final_norm.scale, params["final_norm/scale"])
  if model.lm_head is not None:
    put(model.lm_head.weight, params["lm_head/kernel"].T)
  for i, block in enumerate(model.layers):
    p = lambda name: params[f"layers/{i}/{name}"]  # noqa: E731
    put(block.attention_norm.scale, p("attention_norm/scale"))
    put(block.mlp_norm.scale, p("mlp_norm/scale"))
    put(block.attention.q.weight, p("attention/q_proj/kernel").reshape(d, n * h).T)
    put(block.attention.k_proj.weight, p("attention/k_proj/kernel").reshape(d, k * h).T)
    put(block.attention.v_proj.weight, p("attention/v_proj/kernel").reshape(d, k * h).T)
    put(block.attention.o.weight, p("attention/o_proj/kernel").reshape(n * h, d).T)
    put(block.mlp.gate.weight, p("mlp/gate_proj/kernel").T)
    put(block.mlp.up.weight, p("mlp/up_proj/kernel").T)
    put(block.mlp.down.weight, p("mlp/down_proj/kernel").T)


def schedule_factor(optim_config, total_steps: int):
  """The recipe's warmup + cosine learning rate, as a multiple of the peak (LambdaLR)."""
  c = optim_config
  assert c.schedule == "cosine", c.schedule
  warmup = min(c.warmup_steps, total_steps)
  remaining = max(total_steps - warmup, 1)

  def factor(step: int) -> float:
    if step < warmup:
      return step / warmup
    progress = min(step - warmup, remaining) / remaining
    return c.final_lr_ratio + (1 - c.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

  return factor


def build_optimizer(model: Decoder, optim_config, total_steps: int):
  """AdamW over `model` with the recipe's decay mask, and its schedule."""
  import re

  c = optim_config
  assert c.name == "adamw" and c.accumulate_steps == 1, c
  patterns = [re.compile(p) for p in c.no_decay]
  decay, no_decay = [], []
  for name, param in model.named_parameters():
    jax_like = name.replace(".", "/").replace("/weight", "")  # 'embed', 'layers/0/...'
    (no_decay if any(p.search(jax_like) for p in patterns) else decay).append(param)
  optimizer = torch.optim.AdamW(
      [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
      lr=c.learning_rate, betas=(c.b1, c.b2), eps=c.eps)
  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(c, total_steps))
  return optimizer, scheduler


class Trainer:
  """One variant: a model, its optimizer, and `run(n)` steps on one batch, on `device`."""

  def __init__(self, config, params, batch, optim_config, total_steps: int, *,
               compiled: bool, bf16: bool, device: str = "cpu"):
    torch.manual_seed(0)
    self.device = torch.device(device)
    self.model = Decoder(config)
    load_jax_params(self.model, params, config)
    self.model.to(self.device)  # Before the optimizer takes the parameters.
    self.optimizer, self.scheduler = build_optimizer(self.model, optim_config, total_steps)
    self.forward = torch.compile(self.model) if compiled else self.model
    self.clip = optim_config.grad_clip_norm
    self.bf16 = bf16
    self.inputs = torch.from_numpy(np.asarray(batch["inputs"], np.int64)).to(self.device)
    self.targets = torch.from_numpy(np.asarray(batch["targets"], np.int64)).to(self.device)

  def loss(self):
    if self.bf16:
      with torch.autocast(self.device.type, dtype=torch.bfloat16):
        return lm_loss(self.forward, self.inputs, self.targets)
    return lm_loss(self.forward, self.inputs, self.targets)

  def step(self) -> float:
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.loss()
    loss.backward()
    if self.clip is not None:
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.optimizer.step()
    self.scheduler.step()
    return loss.detach()

  def run(self, n: int) -> Any:
    for _ in range(n):
      loss = self.step()
    return float(loss)  # Waits for the device (the last step's kernels) on a GPU.


def first_loss(config, params, batch) -> float:
  """The float32 eager loss at the JAX model's parameters (no step taken)."""
  model = Decoder(config)
  load_jax_params(model, params, config)
  with torch.no_grad():
    inputs = torch.from_numpy(np.asarray(batch["inputs"], np.int64))
    targets = torch.from_numpy(np.asarray(batch["targets"], np.int64))
    return float(lm_loss(model, inputs, targets))


def components(trainer: Trainer, config, size) -> dict[str, Any]:
  """Thunks that run one part of the step (forward + backward) on its own.

  The same parts as train_step.jax_components, in the trainer's mode (compiled
  or not, autocast or not); the optimizer part is clipping + AdamW over every
  parameter with gradients already there.
  """
  b, t, d = size.batch_size, size.seq_len, config.d_model
  n, k, h = config.num_heads, config.num_kv_heads, config.resolved_head_dim
  gen = torch.Generator().manual_seed(2)
  x = torch.randn(b, t, d, generator=gen, requires_grad=True)
  q = torch.randn(b, t, n, h, generator=gen, requires_grad=True)
  kv = [torch.randn(b, t, k, h, generator=gen, requires_grad=True) for _ in range(2)]
  block = trainer.model.layers[0]
  compile_ = torch.compile if trainer.forward is not trainer.model else (lambda f: f)

  def projections(x):  # As train_step.jax_components: q once, o on it.
    a = block.attention
    qx = a.q(x)
    return qx.sum() + a.k_proj(x).sum() + a.v_proj(x).sum() + a.o(qx).sum()

  def head_loss(x):
    logits = (x @ trainer.model.embed.weight.T)[..., :config.vocab_size].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), trainer.targets.reshape(-1))

  parts = {
      "attention core": (compile_(lambda: core_attention(q, *kv).float().sum()), ()),
      "projections": (compile_(projections), (x,)),
      "MLP": (compile_(lambda x: block.mlp(x).float().sum()), (x,)),
      "head + loss": (compile_(head_loss), (x,)),
  }

  def fwd_bwd(fn, args):
    def run():
      for leaf in (x, q, *kv):  # Each call computes fresh input gradients, as JAX's does.
        leaf.grad = None
      if trainer.bf16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
          out = fn(*args)
      else:
        out = fn(*args)
      out.backward()
      return out.detach()
    return run

  thunks = {name: fwd_bwd(fn, args) for name, (fn, args) in parts.items()}

  def optimizer_step():
    for param in trainer.model.parameters():
      if param.grad is None:
        param.grad = torch.zeros_like(param)
    if trainer.clip is not None:
      torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.clip)
    trainer.optimizer.step()

  thunks["optimizer"] = optimizer_step
  return thunks
