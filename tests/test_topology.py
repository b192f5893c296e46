"""Compile-only TPU and GPU devices: names, the chips' figures, a program compiled for them.

The tests that make devices need libtpu or the CUDA plugin at this row's pin (.ci/run
installs both into one row's venv for this file); without them they are skipped with that
reason, and what this machine can check (the names, the errors that name the package to
install) runs everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from jax_ai_stack import cli, compat, topology
from jax_ai_stack.errors import UsageError

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = compat.installed_version("jax-cuda12-pjrt") is not None
if os.environ.get("JAX_AI_STACK_TEST_TOPOLOGIES") == "1" and not (HAS_LIBTPU and HAS_CUDA_PLUGIN):
  # .ci/run installs both for this file: there, a skip would hide a broken install.
  raise RuntimeError("JAX_AI_STACK_TEST_TOPOLOGIES=1 but libtpu or the CUDA plugin is missing")
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")
needs_cuda_plugin = pytest.mark.skipif(not HAS_CUDA_PLUGIN,
                                       reason="the CUDA plugin (jax-cuda12-pjrt) is not installed")


@pytest.mark.parametrize("text, platform, chip, shape, slices", [
    ("v5e:2x2", "tpu", "v5e", (2, 2), 1),
    ("V6E:4x4", "tpu", "v6e", (4, 4), 1),
    ("v5p:2x2x2/2", "tpu", "v5p", (2, 2, 2), 2),
    ("tpu7x:2x2x1", "tpu", "tpu7x", (2, 2, 1), 1),
    ("h100:8", "gpu", "h100", (1, 8), 1),
    ("b200:2x8", "gpu", "b200", (2, 8), 1),
])
def test_names_parse(text, platform, chip, shape, slices):
  name = topology.parse(text)
  assert (name.platform, name.chip, name.shape, name.slices) == (platform, chip, shape, slices)


@pytest.mark.parametrize("text, message", [
    ("v5e", "is not CHIP:SHAPE; known: TPU slices v4:..., v5e:..."),
    ("v9z:2x2", "unknown chip 'v9z'; known: TPU slices"),
    ("v5e:2x0", "every size must be at least 1"),
    ("h100:2x2x2", "a GPU topology is DEVICES or HOSTSxDEVICES, e.g. h100:8 or h100:2x8"),
    ("h100:8/2", "a GPU topology is DEVICES or HOSTSxDEVICES"),
])
def test_a_bad_name_is_one_line_naming_the_known_ones(text, message):
  with pytest.raises(UsageError, match=message.replace(".", r"\.").replace("(", r"\(")):
    topology.parse(text)


@pytest.mark.parametrize("name, package, accelerator", [
    ("v5e:2x2", "libtpu", "tpu"), ("h100:8", "jax-cuda12-pjrt", "cuda12")])
def test_a_missing_or_other_version_package_says_the_pip_command(monkeypatch, name, package,
                                                                  accelerator):
  row = compat.find_row(compat.load_matrix(), accelerator=accelerator)
  install = f'pip install "{package}=={row.packages[package]}"'
  installed = {}
  monkeypatch.setattr(compat, "installed_version", installed.get)
  with pytest.raises(UsageError, match=f"needs {package}, which is not installed: "
                                       f"{re.escape(install)}"):
    topology.load(name)
  installed[package] = "0.0.1"
  with pytest.raises(UsageError, match=f"{package} 0.0.1 is installed, row {row.name} pins "
                                       f"{re.escape(row.packages[package])}: {re.escape(install)}"):
    topology.load(name)


def test_the_kernels_command_names_a_bad_topology(capsys):
  assert cli.main(["kernels", "--topology", "v5e"]) == 2
  assert "--topology 'v5e' is not CHIP:SHAPE" in capsys.readouterr().err
  assert cli.main(["kernels", "--topology", "v5e:2x2", "--platform", "tpu"]) == 2
  assert "drop --platform" in capsys.readouterr().err


@needs_libtpu
@pytest.mark.parametrize("text, count, kind, cores", [
    ("v5e:2x2", 4, "TPU v5 lite", 1), ("v5p:2x2x2", 8, "TPU v5", 2),
    ("v6e:4x4", 16, "TPU v6 lite", 1), ("v5e:2x2/2", 8, "TPU v5 lite", 1),
    ("v4:2x2x1", 4, "TPU v4", 2),  # One device per chip (megacore), as JAX's meshes need.
])
def test_tpu_slices_are_devices_with_their_chip_s_figures(text, count, kind, cores):
  target = topology.load(text)
  assert len(target.devices) == count
  assert {d.device_kind for d in target.devices} == {kind}
  assert {d.platform for d in target.devices} == {"tpu"}
  assert {getattr(d, "num_cores", 1) for d in target.devices} == {cores}
  # Google's figures per chip (cloud.google.com/tpu/docs): v4 32 GB, v5e 16 GB, v5p 95 GB,
  # v6e 32 GB.
  gigabytes = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}[kind]
  assert abs(target.chip.hbm_bytes / 2**30 - gigabytes) / gigabytes < 0.1
  assert target.chip.bf16_flops_per_s > 1e14
  assert "jax" in target.chip.source


@needs_libtpu
def test_two_processes_compile_for_tpus_at_once():
  """libtpu's lockfile owns a machine's chips; compile-only devices own none, so a second
  dry run (or test worker) beside the first is not refused."""
  code = ("import time; from jax_ai_stack import topology; topology.load('v5e:2x2'); "
          "time.sleep(4)")
  env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
  children = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
  for child in children:
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]


@needs_libtpu
def test_a_slice_libtpu_has_not_is_one_line():
  with pytest.raises(UsageError, match="v5e:3x3: libtpu has no such slice: .*not divisible"):
    topology.load("v5e:3x3")


@needs_libtpu
def test_a_program_compiles_for_a_tpu_slice_and_reports_its_bytes():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  target = topology.load("v5e:2x2")
  mesh = Mesh(np.array(target.devices), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  replicated = NamedSharding(mesh, PartitionSpec())
  x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=rows)
  w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=replicated)
  compiled = jax.jit(lambda x, w: (x @ w).sum()).lower(x, w).compile()
  memory = compiled.memory_analysis()
  # Per device: a quarter of x's rows and all of w.
  assert memory.argument_size_in_bytes >= (16 * 512 + 512 * 512) * 2
  assert compiled.cost_analysis()["flops"] >= 2 * 16 * 512 * 512


@needs_libtpu
def test_the_kernels_command_reports_what_a_tpu_would_run(capsys):
  assert cli.main(["kernels", "--topology", "v5e:2x2"]) == 0  # As docs/kernels.md shows it.
  out = capsys.readouterr().out
  assert "v5e:2x2: 4 x TPU v5 lite (compile-only" in out
  assert "Attention on tpu (TPU v5 lite)" in out
  assert "paged attention (the generation engine's decoding): pallas_tpu" in out


@needs_cuda_plugin
def test_gpu_hosts_are_devices_with_the_plugin_s_target_config():
  target = topology.load("h100:2x4")
  assert len(target.devices) == 8
  assert {d.device_kind for d in target.devices} == {"NVIDIA H100 80GB HBM3"}
  assert target.devices[0].compute_capability == "9.0"
  assert 79 < target.chip.hbm_bytes / 2**30 < 81  # 80 GB HBM3, as the plugin carries it.
  assert target.chip.hbm_bytes_per_s == pytest.approx(3.35e12, rel=0.01)
  assert target.chip.bf16_flops_per_s == 989e12
  assert "jax-cuda12-plugin" in target.chip.source


@needs_cuda_plugin
def test_the_kernels_command_reports_what_an_h100_would_run(capsys):
  assert cli.main(["kernels", "--topology", "h100:8"]) == 0
  out = capsys.readouterr().out
  assert "Attention on gpu (NVIDIA H100 80GB HBM3, compute capability 9.0)" in out
  assert "paged attention (the generation engine's decoding): pallas_gpu" in out
