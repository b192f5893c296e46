"""Recipes compiled ahead of time for TPU slices and GPU hosts (`train --dry-run --topology`).

The compiles need libtpu (or the CUDA plugin) at this row's pin: .ci/run installs them into
one row's venv for this file and tests/test_topology.py; elsewhere those tests are skipped
with that reason, and the arithmetic and the bad-input paths, which need neither, run.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from jax_ai_stack import cli, compat, topology
from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import aot, memory

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")
needs_cuda_plugin = pytest.mark.skipif(compat.installed_version("jax-cuda12-pjrt") is None,
                                       reason="the CUDA plugin (jax-cuda12-pjrt) is not installed")
CHIP = topology.Chip("TPU v5 lite", hbm_bytes=16 * 2**30, hbm_bytes_per_s=8e11,
                     bf16_flops_per_s=2e14, source="a test's")


def program(**overrides) -> aot.Program:
  values = dict(name="train step", seconds=1.0, arguments=100, outputs=100, aliased=100,
                temporaries=50, code=10, flops=2e11, bytes_accessed=8e8)
  return aot.Program(**{**values, **overrides})


def test_a_program_counts_a_donated_argument_once():
  assert program().total == 100 + 100 - 100 + 50 + 10


def test_the_roofline_is_the_slower_of_compute_and_memory():
  least, mfu = program(flops=2e11, bytes_accessed=8e8).roofline(CHIP)  # 1 ms each.
  assert least == pytest.approx(1e-3) and mfu == pytest.approx(1.0)
  least, mfu = program(flops=2e11, bytes_accessed=3.2e9).roofline(CHIP)  # Memory: 4 ms.
  assert least == pytest.approx(4e-3) and mfu == pytest.approx(0.25)
  assert program(flops=None, bytes_accessed=None).roofline(CHIP) is None
  assert "no cost analysis" in program(flops=None, bytes_accessed=None).describe(CHIP)


def test_while_sampling_the_train_state_stays_beside_the_engine():
  """An RL run's rollout decodes with the run's own parameters (counted once) while the
  optimizer state stays on the device: the peak is neither program's alone."""
  train = program(arguments=300, outputs=0, aliased=0, temporaries=500, code=0)
  engine = program(name="engine rollout decode", arguments=150, outputs=0, aliased=0,
                   temporaries=40, code=10, shared=100)
  compiled = aot.Compiled("rl", topology.Topology(topology.parse("v5e:2x2"), (), CHIP), None,
                          (), ("xla", ""), ("xla", ""), None, (train, engine))
  assert compiled.sampling == 300 + 150 + 40 + 10 - 100
  assert compiled.largest is train
  plain = aot.Compiled("lm", compiled.target, None, (), ("xla", ""), ("xla", ""), None, (train,))
  assert plain.sampling is None


def test_a_run_that_does_not_fit_names_the_program_and_the_largest_batch():
  plan = memory.MemoryPlan(mesh={"data": 4}, rules="fsdp", batch_size=8, batch_ways=4,
                           parameters=2**30, reference=0, optimizer=2 * 2**30, gradients=2**30,
                           gathered=0, activations_per_row=2**30, activations_from="a test")
  target = topology.Topology(topology.parse("v5e:2x2"), (), CHIP)
  compiled = aot.Compiled("big", target, None, (), ("xla", ""), ("xla", ""), plan,
                          (program(temporaries=20 * 2**30), program(name="eval step")))
  with pytest.raises(UsageError, match=r"big does not fit v5e:2x2: its train step needs 20\.00 "
                                       r"GiB per device, the TPU v5 lite has 16\.00 GiB; the "
                                       r"largest global batch that fits is about 48 "):
    compiled.check_fits()


def test_topology_needs_dry_run_and_a_known_chip(capsys, tmp_path):
  workdir = tmp_path / "run"
  assert cli.main(["train", "lm-tiny", "--topology", "v5e:2x2", "--workdir", str(workdir)]) == 2
  assert "--topology compiles for chips this machine does not have: add --dry-run" in (
      capsys.readouterr().err)
  assert cli.main(["train", "lm-tiny", "--dry-run", "--topology", "v9:2",
                   "--workdir", str(workdir)]) == 2
  assert "unknown chip 'v9'" in capsys.readouterr().err
  assert not workdir.exists()


@needs_libtpu
@pytest.mark.parametrize("override, message", [
    ("mesh.data=3", "mesh.data=3 x mesh.fsdp=1 x mesh.expert=1 x mesh.tensor=1 = 3 devices, "
                    "but there are 4"),
    ("model.attention_impl=cudnn", "(order from model.attention_impl): cudnn: runs on gpu, not "
                                   "tpu"),
])
def test_a_mesh_or_a_kernel_the_slice_cannot_take_is_one_line(capsys, tmp_path, override,
                                                               message):
  workdir = tmp_path / "run"
  code, out, err = dry_run(capsys, "lm-tiny", override, "--topology", "v5e:2x2",
                           "--workdir", str(workdir))
  assert code == 2 and not out and message in err
  assert len([line for line in err.splitlines() if "error" in line]) == 1
  assert not workdir.exists()


def dry_run(capsys, *argv: str) -> tuple[int, str, str]:
  code = cli.main(["train", *argv, "--dry-run"])
  out, err = capsys.readouterr()
  return code, out, err


def size(pattern: str, out: str) -> float:
  """The bytes of `pattern`'s group ("412 KiB", "7.45 MiB") in `out`."""
  number, unit = re.search(pattern, out)[1].split()
  return float(number) * 2 ** (10 * ["B", "KiB", "MiB", "GiB"].index(unit))


def plan_ratio(out: str) -> float:
  return float(re.search(r"XLA / memory plan: ([\d.]+)", out)[1])


@needs_libtpu
@pytest.mark.slow
def test_lm_tiny_compiles_for_a_v5e_slice_within_the_plan(capsys, tmp_path):
  code, out, _ = dry_run(capsys, "lm-tiny", "--topology", "v5e:2x2",
                         "--workdir", str(tmp_path / "run"))
  assert code == 0
  assert "recipe lm-tiny on v5e:2x2: 4 x TPU v5 lite (compile-only" in out
  assert re.search(r"attention: (tokamax_mosaic_tpu|pallas_tpu_splash)", out), out
  assert re.search(r"train step: compiled in [\d.]+ s; per device [\d.]+ MiB of 16\.\d+ GiB", out)
  assert "eval step: compiled in" in out and "MFU at most" in out
  assert "mesh data 4 x fsdp 1 x expert 1 x tensor 1 (4 devices)" in out
  assert 0.85 <= plan_ratio(out) <= 1.15, out
  assert not (tmp_path / "run").exists()


@needs_libtpu
@pytest.mark.slow
def test_experts_over_the_expert_axis_compile_within_the_plan(capsys, tmp_path):
  code, out, _ = dry_run(capsys, "moe-tiny", "mesh.expert=2", "--topology", "v5e:2x2",
                         "--workdir", str(tmp_path / "run"))
  assert code == 0 and "mesh data 2 x fsdp 1 x expert 2 x tensor 1" in out
  assert "grouped matmul (MoE experts): tokamax" in out
  # A mixture of experts' activations are measured, on this host's CPU, whose programs
  # group the experts' rows in blocks (`blocked`) where a TPU's call tokamax: up to a
  # fifth more than the chip's (issue 60: measure them on the topology instead).
  assert 0.75 <= plan_ratio(out) <= 1.15, out


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek_v3-tiny", "qwen3_next-tiny"])
def test_the_2026_families_compile_for_a_tpu_within_the_plan(preset, capsys, tmp_path):
  """DeepSeek-V3's latent attention and grouped sigmoid routing, Qwen3-Next's gated DeltaNet
  (its chunked rule: a triangular inverse by forward substitution) beside splash attention."""
  code, out, _ = dry_run(capsys, preset, "--topology", "v5e:2x2",
                         "--workdir", str(tmp_path / "run"))
  assert code == 0 and "train step: compiled in" in out and "eval step: compiled in" in out
  assert "grouped matmul (MoE experts): tokamax" in out
  assert 0.75 <= plan_ratio(out) <= 1.15, out


@needs_libtpu
@pytest.mark.slow
def test_a_kernel_the_chip_s_compiler_refuses_falls_back_with_its_reason(capsys, tmp_path):
  """lm-tiny-grpo's 64-token rows: the Mosaic kernels' 128-row blocks do not divide them,
  and XLA:TPU refuses tokamax's XLA attention in float32 (its dot algorithm F32_F32_F32):
  what a TPU would refuse, refused here, and the next kernel of the order compiled.

  Its rollouts' engine is compiled too, as each of a v5p:2x2x2's two hosts runs it: a whole
  copy of the policy on the host's first chip, beside that chip's share of the train state."""
  code, out, _ = dry_run(capsys, "lm-tiny-grpo", "mesh.data=1", "mesh.fsdp=-1",
                         "--topology", "v5p:2x2x2", "--workdir", str(tmp_path / "run"))
  assert code == 0
  assert "attention: xla" in out
  assert "refused by the compiler: tokamax_xla: UNIMPLEMENTED: Dot algorithm" in out
  assert "engine rollout prefill: compiled in" in out
  engine = size(r"engine rollout decode: .* arguments ([\d.]+ \w+)", out)
  shard = size(r"parameters +([\d.]+ \w+)", out)  # fsdp over 8 chips.
  assert engine > 8 * shard, out  # The whole policy, and its page pool.
  assert size(r"while sampling: ([\d.]+ \w+) per device", out) > engine, out
  # A slot per completion: 16 prompts x 8, 64 at most, each with pages for 128 positions.
  pool = 2 * 4 * 2 * (64 * 128 // 64 + 1) * 64 * 32 * 4  # Keys and values, 4 layers, f32.
  assert size(r"engine rollout decode: .*\(([\d.]+ \w+) of them in donated", out) >= pool


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("recipe", [["lm-tiny-dpo"], ["lm-tiny", "quant.qat=w8a8"]],
                         ids=["dpo-lora", "qat"])
def test_a_run_s_transforms_compile_for_a_tpu_slice(capsys, tmp_path, recipe):
  """DPO's LoRA adapters over a frozen reference (the base's weights, read by no one here),
  and QAT's fake-quantized matmuls: the train step with its transforms, on a v5e slice whose
  attention is Mosaic's alone (Qwix runs the model once to place them: 128 tokens, a
  block of that kernel)."""
  code, out, _ = dry_run(capsys, *recipe, "model.attention_impl=tokamax_mosaic_tpu",
                         "--topology", "v5e:2x2", "--workdir", str(tmp_path / "run"))
  assert code == 0, out
  assert "attention: tokamax_mosaic_tpu" in out
  assert re.search(r"train step: compiled in [\d.]+ s; per device [\d.]+ MiB", out)


@needs_libtpu
@pytest.mark.parametrize("tensor", [1, 2], ids=["data 4", "data 2 x tensor 2"])
def test_a_run_that_evaluates_on_tasks_compiles_the_engine_its_harness_generates_with(tensor):
  """Heads of 128 in bfloat16: the TPU's ragged paged-attention kernel decodes, in each data
  replica's own pool, with the heads split over `tensor` (a `shard_map` over every axis: a
  Mosaic kernel is not partitioned, and before it a split of the heads failed to compile)."""
  from jax_ai_stack.recipes import config
  from jax_ai_stack.recipes.evaluation import in_training

  run = config.load("lm-tiny", overrides=[
      "model.num_layers=1", "model.d_model=256", "model.num_heads=2", "model.num_kv_heads=2",
      "model.dtype=bfloat16", "train.eval_every=10", "train.eval_tasks=[hellaswag]",
      f"mesh.tensor={tensor}", "mesh.rules=fsdp_tp"])
  compiled = aot.compile_recipe(run, topology.load("v5e:2x2"), environ={})
  names = [p.name for p in compiled.programs]
  assert names == ["train step", "eval step", "engine evaluation prefill",
                   "engine evaluation decode"]
  assert compiled.sampling > compiled.programs[0].arguments
  prefill, decode = compiled.programs[2:]
  assert prefill.kernels == decode.kernels == ("ragged_paged_attention_kernel",)
  assert any(k.startswith("splash") for k in compiled.programs[0].kernels)
  c, replicas = run.model, 4 // tensor  # Every slot's whole context in pages (and a page 0
  # per replica), over the replicas and the key/value heads over `tensor`.
  pool = 2 * c.num_layers * c.num_kv_heads * (
      in_training.BATCH_SIZE * c.max_seq_len + replicas * 64) * (c.resolved_head_dim * 2) // 4
  assert decode.aliased == prefill.aliased == pool  # Donated, and split over the devices.


@needs_libtpu
@pytest.mark.slow
def test_a_batch_that_does_not_fit_is_one_line_with_the_largest_that_does(capsys, tmp_path):
  code, out, err = dry_run(capsys, "lm-tiny", "data.batch_size=65536", "model.attention_impl=xla",
                           "--topology", "v5e:2x2", "--workdir", str(tmp_path / "run"))
  assert code == 2 and not out
  assert re.search(r"lm-tiny does not fit v5e:2x2: RESOURCE_EXHAUSTED: .*HBM.*; the largest "
                   r"global batch that fits is about [\d,]+ \(data\.batch_size\)", err), err
  assert len(err.strip().splitlines()) == 1


@needs_cuda_plugin
@pytest.mark.slow
def test_lm_tiny_compiles_for_an_h100_host_within_the_plan(capsys, tmp_path):
  """The CUDA plugin's H100 from its own target config: tokamax's Triton attention compiles
  (its Mosaic GPU kernel picks its code by the host's device, so it refuses here), without
  XLA's deterministic ops, which deviceless GPU compiles cannot autotune."""
  code, out, _ = dry_run(capsys, "lm-tiny", "--topology", "h100:8",
                         "--workdir", str(tmp_path / "run"))
  one, alone, _ = dry_run(capsys, "lm-tiny", "--topology", "h100:1",  # No mesh but the target's.
                          "--workdir", str(tmp_path / "run"))
  assert one == 0 and "attention: tokamax_triton" in alone
  assert code == 0
  assert "recipe lm-tiny on h100:8: 8 x NVIDIA H100 80GB HBM3 (compile-only" in out
  assert "attention: tokamax_triton" in out
  assert "compiled without XLA's deterministic GPU ops" in out
  assert re.search(r"train step: compiled in [\d.]+ s; per device [\d.]+ MiB of 79\.\d+ GiB", out)
  assert 0.85 <= plan_ratio(out) <= 1.15, out


@needs_cuda_plugin
@pytest.mark.slow
def test_experts_compile_for_an_h100_host(capsys, tmp_path):
  """tokamax's GPU grouped matmuls read this host's device (Mosaic GPU refuses the
  architecture; Triton needs jax_triton): a compile-only H100 gets XLA's ragged_dot."""
  code, out, _ = dry_run(capsys, "moe-tiny", "mesh.expert=2", "--topology", "h100:8",
                         "--workdir", str(tmp_path / "run"))
  assert code == 0
  assert "compiled here as XLA's ragged_dot" in out
  assert re.search(r"train step: compiled in [\d.]+ s; per device [\d.]+ MiB", out)


def has_cudnn() -> bool:
  try:
    return importlib.util.find_spec("nvidia.cudnn") is not None
  except ModuleNotFoundError:  # No `nvidia` package at all.
    return False


@needs_cuda_plugin
@pytest.mark.slow
def test_cudnn_attention_compiles_for_an_h100_where_its_wheels_are_installed(capsys, tmp_path):
  """jax's cuDNN attention builds its cuDNN graph as it lowers: with the cuDNN wheels (the
  cuda12 extra's) it compiles for the H100; without, it falls back, saying so."""
  code, out, _ = dry_run(capsys, "lm-tiny", "model.attention_impl=cudnn,xla",
                         "model.dtype=bfloat16", "--topology", "h100:1",
                         "--workdir", str(tmp_path / "run"))
  assert code == 0
  if has_cudnn():
    assert "attention: cudnn\n" in out, out
  else:
    assert "attention: xla (over cudnn: RuntimeError when traced: cuDNN not found.)" in out, out


@needs_libtpu
@needs_cuda_plugin
def test_a_topology_command_starts_only_the_host_s_cpu_backend(tmp_path):
  """With the CUDA plugin installed and no CUDA libraries (this row's venv), JAX's start-up
  logs a traceback unless JAX_PLATFORMS names the CPU: a --topology command starts the CPU
  backend alone, the user having set nothing."""
  import os
  import subprocess
  import sys

  env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
  result = subprocess.run(
      [sys.executable, "-c", "import sys; from jax_ai_stack import cli; sys.exit(cli.main("
       f"['train', 'lm-tiny', '--dry-run', '--topology', 'v5e:2x2', '--workdir', "
       f"'{tmp_path / 'run'}', 'model.num_layers=1']))"],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0 and "TPU v5 lite" in result.stdout, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
