"""Every TPU kernel the selection can pick, compiled ahead of time for a TPU v5e chip at a
shape a preset uses, with what is chosen, why, and what falls back where the chip's
compiler refuses a kernel (`kernels.lowering`).

The devices are libtpu's compile-only ones (`jax_ai_stack.topology`): without libtpu these
tests are skipped with that reason; with JAX_AI_STACK_TEST_TOPOLOGIES=1 (.ci/run's
topology row) a missing libtpu is an error instead. Which Mosaic kernel a program calls is
read from its lowered text (`kernel_name`). Each compile takes about a second. What a
kernel computes is checked on CPU in Pallas interpret mode (here the grouped matmul; the
attention kernels in test_kernels_attention.py), which needs no libtpu.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack import kernels, topology
from jax_ai_stack.kernels import lowering, paged, paged_tpu
from jax_ai_stack.recipes import config as config_lib

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
if os.environ.get("JAX_AI_STACK_TEST_TOPOLOGIES") == "1" and not HAS_LIBTPU:
  raise RuntimeError("JAX_AI_STACK_TEST_TOPOLOGIES=1 but libtpu is missing")
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")


@pytest.fixture(scope="module")
def chip():
  if not HAS_LIBTPU:
    pytest.skip("libtpu is not installed")
  return topology.load("v5e:2x2").devices[0]


def mosaic_kernels(function, args, device) -> set[str]:
  """The Mosaic kernels `function` calls when lowered for `device` (its `kernel_name`s)."""
  mesh = jax.sharding.Mesh([device], ("one",))
  placed = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args]
  with (kernels.compiling_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
    text = jax.jit(function).lower(*args).as_text()
  return set(re.findall(r'kernel_name\s*=\s*"([^"]+)"', text))


def preset_request(name: str, layer: int) -> kernels.Request:
  """The training step's attention request of `name`'s layer `layer` (batch and length)."""
  config = config_lib.load(name)
  model = config.model
  shape = (config.data.batch_size, config.data.seq_len)
  return kernels.Request.from_shapes(
      (*shape, model.num_heads, model.resolved_head_dim),
      (*shape, model.num_kv_heads, model.resolved_head_dim), "bfloat16", causal=True,
      segment_ids=True, local_window=model.local_window(layer), scale=model.attention_scale,
      logits_soft_cap=model.attn_logit_softcap)


ATTENTION = [  # preset, layer, what compiles, its Mosaic kernel.
    ("lm-tiny", 0, "tokamax_mosaic_tpu", "splash_mha_fwd"),  # Causal.
    ("gemma3-tiny", 0, "pallas_tpu_splash", "splash_mha_fwd"),  # Sliding window.
    ("gemma3-tiny", 5, "tokamax_mosaic_tpu", "splash_mha_fwd"),  # Its global layer.
    ("gemma2-tiny", 0, "pallas_tpu_splash", "splash_mha_fwd"),  # Window and soft cap.
    ("gemma2-tiny", 1, "tokamax_mosaic_tpu", "splash_mha_fwd"),  # Soft cap.
]


@pytest.mark.parametrize("preset, layer, name, kernel", ATTENTION,
                         ids=[f"{p}-layer{layer}" for p, layer, *_ in ATTENTION])
def test_attention_compiles_for_the_chip_forward_and_backward(chip, preset, layer, name,
                                                              kernel):
  request = preset_request(preset, layer)
  lowered = lowering.attention_that_compiles(request, chip)
  assert (lowered.name, lowered.refused) == (name, ())
  plan = kernels.AttentionPlan((name,), "a test", backend=kernels.backend_of(chip))

  def loss(q, k, v, ids):
    out = kernels.attention(q, k, v, segment_ids=ids, local_window=request.local_window,
                            scale=request.scale, logits_soft_cap=request.logits_soft_cap,
                            plan=plan)
    return out.astype(jnp.float32).sum()

  args = lowering._attention_args(request)  # pylint: disable=protected-access
  called = mosaic_kernels(jax.grad(loss, argnums=(0, 1, 2)), args, chip)
  # The forward kernel and its backward ones.
  assert any(k.startswith(kernel) for k in called) and len(called) > 1, called


def test_what_the_mosaic_attention_lacks_is_said(chip):
  """Why the gemma presets' layers do not get tokamax's Mosaic kernel."""
  backend = kernels.backend_of(chip)
  with kernels.compiling_for("tpu"):
    window = kernels.AttentionPlan(("auto",), "t", backend=backend).report(
        preset_request("gemma3-tiny", 0))
  reasons = {v.name: v.reason for v in window.verdicts}
  assert "window size are not supported" in reasons["tokamax_mosaic_tpu"]


def moe_tiny_shapes(rows: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
  model = config_lib.load("moe-tiny").model
  return (rows, model.d_model), (model.moe.num_experts, model.d_model, model.expert_mlp_dim)


def test_the_grouped_matmul_is_tokamax_s_mosaic_kernel_at_moe_tiny_s_shape(chip):
  config = config_lib.load("moe-tiny")
  rows = config.data.batch_size * config.data.seq_len * config.model.moe.num_experts_per_tok
  lhs, rhs = moe_tiny_shapes(rows)  # 2048 rows of 128 by 8 experts' [128, 192].
  lowered = lowering.grouped_matmul_that_compiles("auto", chip, lhs, rhs)
  assert lowered.name == "tokamax_mosaic_tpu" and not lowered.refused
  assert "tokamax resolves 'mosaic' by the host's device" in lowered.why
  args = (jax.ShapeDtypeStruct(lhs, jnp.bfloat16), jax.ShapeDtypeStruct(rhs, jnp.bfloat16),
          jax.ShapeDtypeStruct(rhs[:1], jnp.int32))
  called = mosaic_kernels(
      lambda *a: kernels.grouped_matmul(*a, implementation=lowered.name), args, chip)
  assert called, "no Mosaic kernel: XLA's ragged_dot ran"
  # "tokamax" on a TPU is the same kernel, named.
  assert kernels.choose_grouped_matmul("tokamax", "tpu")[0] == "tokamax_mosaic_tpu"


def test_a_kernel_traced_for_a_chip_this_host_lacks_is_chosen_for_that_chip(chip):
  """"auto" at trace time reads the devices compiled for (the abstract mesh's), not this
  host's CPU: the grouped matmul and paged attention a TPU program calls are the TPU's."""
  from jax_ai_stack.kernels import request

  mesh = jax.sharding.Mesh([chip], ("one",))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert request.target_backend().device_kind == chip.device_kind
    assert paged.choose_paged_attention("auto")[0] == "pallas_tpu"
  assert request.target_backend().platform == "cpu"
  assert paged.choose_paged_attention("auto")[0] == "xla"


@pytest.mark.slow
@pytest.mark.cpu_backend
def test_the_mosaic_grouped_matmul_equals_the_dense_reference_in_interpret_mode(chip,
                                                                              monkeypatch):
  """tokamax's Mosaic TPU ragged_dot through our adapter, interpreted on this CPU (its op
  has an interpret switch), forward and gradients, against every expert on every row. Its
  tiles are the v5e's (an abstract mesh of the chip names it; the arrays stay here)."""
  from jax_ai_stack.kernels import implementations

  api = importlib.import_module("tokamax._src.ops.ragged_dot.api")
  implementations.import_tokamax()
  interpreted = dataclasses.replace(api.IMPLEMENTATIONS["mosaic_tpu"], interpret=True,
                                    vjp=None)  # Its backward then interprets too.
  monkeypatch.setattr(api, "IMPLEMENTATIONS", {**api.IMPLEMENTATIONS, "mosaic_tpu": interpreted})
  keys = jax.random.split(jax.random.key(0), 2)
  lhs = jax.random.normal(keys[0], (256, 128), jnp.float32)
  rhs = jax.random.normal(keys[1], (4, 128, 128), jnp.float32)
  sizes = jnp.asarray([100, 0, 60, 64], jnp.int32)  # An empty expert; 32 rows past them.

  def value_and_grads(name):
    f = lambda l, r: (kernels.grouped_matmul(l, r, sizes, implementation=name) ** 2).sum()
    return kernels.grouped_matmul(lhs, rhs, sizes, implementation=name), jax.grad(
        f, argnums=(0, 1))(lhs, rhs)

  mesh = jax.sharding.Mesh([chip], ("one",))
  with kernels.compiling_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    mosaic = value_and_grads("tokamax_mosaic_tpu")  # compiling_for: its device check off.
  for actual, wanted in zip(jax.tree.leaves(mosaic), jax.tree.leaves(value_and_grads("dense"))):
    scale = max(1.0, float(jnp.abs(wanted).max()))
    np.testing.assert_allclose(actual / scale, wanted / scale, atol=2e-5)


def test_a_decoding_step_s_few_rows_take_xla_s_ragged_dot_and_say_why(chip):
  lhs, rhs = moe_tiny_shapes(16)  # 8 rows decoding, 2 experts each.
  lowered = lowering.grouped_matmul_that_compiles("auto", chip, lhs, rhs)
  assert lowered.name == "xla"
  assert "takes M, K, N >= 128, not lhs [16, 128]" in lowered.why


def test_paged_attention_at_a_tiny_preset_s_head_dim_is_the_xla_loop(chip):
  model = config_lib.load("lm-tiny").model  # head_dim 32: not the TPU kernel's lanes.
  lowered = lowering.paged_attention_that_compiles(
      "auto", chip, (8, 1, model.num_heads, model.resolved_head_dim),
      (model.num_kv_heads, 65, 16, model.resolved_head_dim), 8)
  assert lowered.name == "xla" and "does not take head_dim 32" in lowered.why


EIGHT_B = dict(heads=32, kv_heads=8, head_dim=128, page_size=16)  # Llama-3-8B's attention.


def eight_b_shapes(rows: int, width: int):
  s = EIGHT_B
  return ((rows, 1, s["heads"], s["head_dim"]),
          (s["kv_heads"], rows * width + 1, s["page_size"], s["head_dim"]))


def test_paged_attention_is_the_ragged_kernel_at_8b_shapes_and_copies_the_table_s_pages(chip):
  rows, width = 32, 32  # 32 rows of 512 positions.
  q, pool = eight_b_shapes(rows, width)
  lowered = lowering.paged_attention_that_compiles("auto", chip, q, pool, width)
  assert lowered == lowering.Lowered("pallas_tpu", lowered.why)
  args = (jax.ShapeDtypeStruct(q, jnp.bfloat16), *[jax.ShapeDtypeStruct(pool, jnp.bfloat16)] * 2,
          jax.ShapeDtypeStruct((rows, width), jnp.int32), jax.ShapeDtypeStruct((rows, 1), jnp.int32))
  run = lambda *a: paged.paged_attention(*a, scale=0.1, implementation="pallas_tpu")
  assert mosaic_kernels(run, args, chip) == {"ragged_paged_attention_kernel"}
  # The adapter gathers every page the table names into the kernel's layout, in each layer
  # at each step: a temporary as large as those pages (docs/kernels.md gives the figures).
  mesh = jax.sharding.Mesh([chip], ("one",))
  placed = jax.sharding.SingleDeviceSharding(chip)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(run).lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)
                                    for a in args]).compile()
  pages = 2 * rows * width * EIGHT_B["page_size"] * EIGHT_B["kv_heads"] * EIGHT_B["head_dim"] * 2
  assert compiled.memory_analysis().temp_size_in_bytes >= pages  # 64 MiB.
  # Over a pool in the kernel's own layout (what a model decoding with it lays out,
  # `layers.Attention._fused_pool`), no copy: the kernel reads the pages where they are.
  q_shape, (heads, count, page_size, head_dim) = eight_b_shapes(rows, width)
  fused = (jax.ShapeDtypeStruct(q_shape, jnp.bfloat16, sharding=placed),
           jax.ShapeDtypeStruct((count, page_size, 2 * heads, head_dim), jnp.bfloat16,
                                sharding=placed), *[
               jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args[3:]])
  with (kernels.compiling_for("tpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
    compiled = jax.jit(lambda q, kv, table, at: paged_tpu.pallas_tpu(q, kv, table, at, scale=0.1)
                       ).lower(*fused).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < pages // 16


@pytest.mark.slow
def test_paged_attention_at_long_rows_is_the_kernel_in_blocks_that_fit_its_vmem(chip):
  for width in (128, 512):  # 2048 and 8192 positions a row.
    q, pool = eight_b_shapes(8, width)
    lowered = lowering.paged_attention_that_compiles("auto", chip, q, pool, width)
    assert lowered == lowering.Lowered("pallas_tpu", lowered.why), (width, lowered)


@pytest.mark.slow
def test_paged_attention_the_compiler_refuses_falls_back_to_xla_with_its_reason(chip,
                                                                                monkeypatch):
  monkeypatch.setattr(paged_tpu, "KV_BLOCK_VMEM", 1 << 30)  # The untuned block of 128 pages.
  rows, width = 32, 128  # 2048 positions a row: that block overflows scoped VMEM.
  q, pool = eight_b_shapes(rows, width)
  lowered = lowering.paged_attention_that_compiles("auto", chip, q, pool, width)
  assert lowered.name == "xla"
  assert lowered.refused[0].startswith("pallas_tpu: RESOURCE_EXHAUSTED")
  assert "Vmem" in lowered.refused[0]


def test_the_head_s_loss_compiles_for_a_chip_beside_tokamax_s_kernel(chip, tmp_path):
  """benchmarks/chunked_loss.py --topology: each way of the head's loss and its gradient, and
  tokamax's Mosaic linear_softmax_cross_entropy_loss, compiled for a v5e; the chunked ways hold
  less than the whole logits."""
  import importlib.util
  import pathlib
  import sys

  benchmarks = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
  if str(benchmarks) not in sys.path:
    sys.path.append(str(benchmarks))  # Its `import common`, as `python benchmarks/...` has.
  spec = importlib.util.spec_from_file_location("_benchmark_chunked_loss",
                                                benchmarks / "chunked_loss.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  shape = {"vocab": 2048, "d_model": 256, "batch": 1, "tokens": 1024, "chunk": 256,
           "vocab_tile": 512}
  memory = module.on_chip(shape, "v5e:2x2", tmp_path / "out.json")["bytes"]
  assert set(memory) == {"unchunked", "chunked", "tiled", "tokamax"}
  peaks = {way: figures["peak"] for way, figures in memory.items()}
  assert all(peak > 0 for peak in peaks.values()), peaks
  assert peaks["chunked"] < peaks["unchunked"], peaks
