"""Compile-only devices of chips this machine does not have: TPU slices and GPU hosts.

libtpu makes a TPU slice's devices from its name (`v5e:2x2`), and the CUDA plugin a
GPU host's from a target config that it carries for each chip it knows (`h100:8`).
Neither needs the chip: a program lowered over a mesh of those devices and compiled
is the program the chip would run, and XLA's memory and cost analyses of it are the
chip's. Nothing is allocated. What depends on the hardware (kernels, block sizes,
memory) reads these devices exactly as it reads attached ones.

A name is `CHIP:SHAPE`: a TPU slice's chips (`v5e:2x2`, `v5p:2x2x2`, `v6e:4x4`,
`tpu7x:2x2x1`; `/N` after it: N such slices, `v5e:2x2/2`), or a GPU host's devices
(`h100:8`; `h100:2x8`, 2 hosts of 8).

Example:
  >>> parse("v5p:2x2x2/2")
  Name(text='v5p:2x2x2/2', platform='tpu', chip='v5p', shape=(2, 2, 2), slices=2)
  >>> parse("h100:2x8").shape
  (2, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import mmap
import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

from jax_ai_stack import compat
from jax_ai_stack.errors import UsageError

__all__ = ["Chip", "Name", "Topology", "GPU_KINDS", "TPU_CHIPS", "chip_of", "load", "parse"]

TPU_CHIPS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
"""The TPU generations libtpu makes slices of, by the names its topologies take."""
MEGACORE_CHIPS = ("v4", "v5p")
"""Chips of two TensorCores that JAX runs as one device ("megacore"), as a Cloud TPU VM
does: libtpu's topologies give a v4 one device per core unless asked (and JAX's mesh
building then refuses them), as MaxText's train_compile asks too."""

GPU_KINDS = {
    "h100": "NVIDIA H100 80GB HBM3", "h100-pcie": "NVIDIA H100 PCIe",
    "h200": "NVIDIA H200 141GB HBM3e", "a100": "NVIDIA A100-SXM4-80GB",
    "a100-40gb": "NVIDIA A100-SXM4-40GB", "b200": "NVIDIA B200", "b300": "NVIDIA B300",
    "gb200": "NVIDIA GB200", "gb300": "NVIDIA GB300",
}
"""Our short GPU names -> the device kind whose target config the CUDA plugin carries."""

GPU_BF16_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H200 141GB HBM3e": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA B200": 2250.0,
    "NVIDIA B300": 2250.0, "NVIDIA GB200": 2500.0, "NVIDIA GB300": 2500.0,
}
"""Dense bfloat16 peaks (TFLOP/s) from NVIDIA's datasheets: the plugin's target configs give
memory size and bandwidth but no tensor-core rate."""

_NAME = re.compile(r"(?P<chip>[a-z0-9-]+):(?P<shape>\d+(?:x\d+)*)(?:/(?P<slices>\d+))?")
_QUIET_LIBTPU = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                 "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
"""What libtpu asks a Cloud TPU VM's metadata server for, said up front: without it libtpu
prints three warnings about a machine that has no TPU, which it does not need to compile.
And leave to share: libtpu takes /tmp/libtpu_lockfile to own the chips, so a second process
compiling at once (a test worker, another dry run) was refused ("multi-process lockfile"),
where compile-only devices own no chip."""
_CUDA_PLUGIN = "jax-cuda12-plugin"
_CUDA_PJRT = "jax-cuda12-pjrt"
"""The CUDA plugin's two packages: the PJRT plugin (its library carries the target configs)
and the kernels' extensions (Triton, Mosaic GPU) that it loads."""
_TPU_VERSIONS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                 "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "7x"}
"""JAX's device kinds -> its `pltpu.ChipVersion` values, whose table has the figures."""


@dataclasses.dataclass(frozen=True)
class Name:
  """A topology name, parsed (see the module)."""

  text: str
  platform: str
  """"tpu" or "gpu"."""
  chip: str
  shape: tuple[int, ...]
  """A TPU slice's chips per axis; a GPU topology's (hosts, devices per host)."""
  slices: int = 1


@dataclasses.dataclass(frozen=True)
class Chip:
  """What one device of a chip holds and does, per device (a TPU7x chip is two devices)."""

  device_kind: str
  hbm_bytes: int
  hbm_bytes_per_s: float
  bf16_flops_per_s: float | None
  source: str
  """Where the numbers come from, with the version."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """The compile-only devices of a named topology, and their chip."""

  name: Name
  devices: tuple[Any, ...]
  chip: Chip

  def describe(self) -> str:
    tflops = (f"{self.chip.bf16_flops_per_s / 1e12:.0f} TFLOP/s bf16"
              if self.chip.bf16_flops_per_s else "peak unknown")
    return (f"{self.name.text}: {len(self.devices)} x {self.chip.device_kind} "
            f"(compile-only; per device {self.chip.hbm_bytes / 2**30:.1f} GiB HBM at "
            f"{self.chip.hbm_bytes_per_s / 1e9:.0f} GB/s, {tflops}; {self.chip.source})")


def _known() -> str:
  return (f"TPU slices {', '.join(f'{c}:...' for c in TPU_CHIPS)} (e.g. v5e:2x2, v5p:2x2x2, "
          f"v6e:4x4, tpu7x:2x2x1; /N for N slices), GPU hosts "
          f"{', '.join(f'{g}:N' for g in GPU_KINDS)} (N devices, or HOSTSxN)")


def parse(text: str) -> Name:
  """`text` as a topology `Name`; a `UsageError` naming the known ones if it is not one."""
  match = _NAME.fullmatch(text.strip().lower())
  if not match:
    raise UsageError(f"--topology {text!r} is not CHIP:SHAPE; known: {_known()}")
  chip, slices = match["chip"], int(match["slices"] or 1)
  shape = tuple(int(n) for n in match["shape"].split("x"))
  if chip in TPU_CHIPS:
    platform = "tpu"
  elif chip in GPU_KINDS:
    platform = "gpu"
    if len(shape) > 2 or match["slices"]:
      raise UsageError(f"--topology {text!r}: a GPU topology is DEVICES or HOSTSxDEVICES, "
                       f"e.g. {chip}:8 or {chip}:2x8")
    shape = shape if len(shape) == 2 else (1, *shape)
  else:
    raise UsageError(f"--topology {text!r}: unknown chip {chip!r}; known: {_known()}")
  if 0 in shape or slices == 0:
    raise UsageError(f"--topology {text!r}: every size must be at least 1")
  return Name(text, platform, chip, shape, slices)


def host_cpu_only() -> None:
  """For a command whose programs are all for --topology's chips: this host's own devices run
  none of them, so JAX starts its CPU backend alone where JAX_PLATFORMS is unset (an installed
  CUDA plugin without CUDA's libraries would log a traceback at start-up; the topology's
  devices come from libtpu and the plugin all the same). Not for a library call: a notebook's
  own backend is left as it is."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  if "JAX_PLATFORMS" not in os.environ and not xla_bridge.backends_are_initialized():
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_platforms", "cpu")


def load(text: str) -> Topology:
  """The compile-only devices of topology `text` (see the module).

  Raises:
    UsageError: an unknown or malformed name, a shape the chip's slices do not come in,
      or the package that makes the devices (libtpu, the CUDA plugin) missing or at
      another version than this Python's row pins.
  """
  name = parse(text)
  if name.platform == "tpu":
    devices = _tpu_devices(name)
  else:
    devices = _gpu_devices(name)
  return Topology(name, tuple(devices), chip_of(devices[0]))


def _require(package: str, accelerator: str, text: str) -> None:
  """A `UsageError` unless `package` is installed at the pin of this Python's
  `accelerator` row; it says the pip command that installs it."""
  row = compat.find_row(compat.load_matrix(), accelerator=accelerator)
  pinned, installed = row.packages.get(package), compat.installed_version(package)
  install = f'pip install "{package}=={pinned}"' if pinned else f"pip install {package}"
  if installed is None:
    raise UsageError(f"--topology {text} needs {package}, which is not installed: {install} "
                     f"(row {row.name})")
  if pinned and installed != pinned:
    raise UsageError(f"--topology {text}: {package} {installed} is installed, row {row.name} "
                     f"pins {pinned}: {install}")


def _tpu_devices(name: Name) -> list[Any]:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  _require("libtpu", "tpu", name.text)
  topology = f"{name.chip}:{'x'.join(map(str, name.shape))}"
  kwargs = {"num_slices": name.slices} if name.slices > 1 else {}
  if name.chip in MEGACORE_CHIPS:
    kwargs["chip_config_name"] = "megacore"
  with _environ_defaults(_QUIET_LIBTPU):
    try:
      return list(topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                               **kwargs).devices)
    except Exception as e:  # libtpu's INVALID_ARGUMENT: a shape the chip has no slice of.
      if "INVALID_ARGUMENT" not in str(e):
        raise
      reason = str(e).split("INVALID_ARGUMENT: ", 1)[-1].splitlines()[0]
      raise UsageError(f"--topology {name.text}: libtpu has no such slice: {reason}") from None


def _gpu_devices(name: Name) -> list[Any]:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  _require(_CUDA_PJRT, "cuda12", name.text)
  _require(_CUDA_PLUGIN, "cuda12", name.text)
  hosts, per_host = name.shape
  return list(topologies.get_topology_desc(
      platform="cuda", topology_name="", topology=f"1x{hosts}x{per_host}",
      target_config=gpu_target_config(GPU_KINDS[name.chip])).devices)


@contextlib.contextmanager
def _environ_defaults(values: dict[str, str]) -> Iterator[None]:
  """`values` set in os.environ where unset, for the block only."""
  added = [key for key in values if key not in os.environ]
  os.environ.update({key: values[key] for key in added})
  try:
    yield
  finally:
    for key in added:
      os.environ.pop(key, None)


def _cuda_plugin_library() -> pathlib.Path:
  files = importlib.metadata.files(_CUDA_PJRT) or []
  found = [f for f in files if f.name == "xla_cuda_plugin.so"]
  if not found:
    raise UsageError("the CUDA plugin's library (xla_cuda_plugin.so) is not installed: "
                     'pip install -e ".[cuda12]"')
  return pathlib.Path(found[0].locate())


@functools.cache
def gpu_target_config(device_kind: str) -> str:
  """The `GpuTargetConfigProto` text that the CUDA plugin carries for `device_kind`.

  XLA builds these specs into the plugin for compiling without a GPU; they are read from
  the installed plugin's library, not retyped here, so they follow its version.
  """
  with open(_cuda_plugin_library(), "rb") as f, mmap.mmap(f.fileno(), 0,
                                                          access=mmap.ACCESS_READ) as data:
    tag = f'device_description_str: "{device_kind}"'.encode()
    at = data.find(tag)
    if at < 0:
      raise UsageError(f"the installed CUDA plugin carries no target config for {device_kind}")
    start = data.rfind(b"\0", 0, at) + 1
    return data[start:data.find(b"\0", at)].decode()


def chip_of(device: Any) -> Chip:
  """What one `device` (attached or compile-only) holds and does (see `Chip`)."""
  if device.platform == "tpu":
    return _tpu_chip(device)
  if device.platform == "gpu":
    return _gpu_chip(device.device_kind)
  raise UsageError(f"no chip figures for {device.platform} devices ({device.device_kind})")


def _tpu_chip(device: Any) -> Chip:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  version = _TPU_VERSIONS.get(device.device_kind)
  if version is None:
    raise UsageError(f"no chip figures for {device.device_kind}")
  cores = getattr(device, "num_cores", 1)  # 2 where a device is a megacore chip (v4, v5p).
  info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(version), cores)
  return Chip(device.device_kind, info.hbm_capacity_bytes * cores,
              float(info.mem_bw_bytes_per_second * cores),
              float(info.bf16_ops_per_second * cores),
              f"jax {jax.__version__}'s TPU table (jax.experimental.pallas.tpu)")


def _gpu_chip(device_kind: str) -> Chip:
  config = gpu_target_config(device_kind)
  memory = int(re.search(r"device_memory_size: (\d+)", config)[1])
  bandwidth = float(re.search(r"memory_bandwidth: (\d+)", config)[1])
  tflops = GPU_BF16_TFLOPS.get(device_kind)
  version = compat.installed_version(_CUDA_PLUGIN)
  return Chip(device_kind, memory, bandwidth, tflops * 1e12 if tflops else None,
              f"{_CUDA_PLUGIN} {version}'s target config; bf16 peak from NVIDIA's datasheet")
