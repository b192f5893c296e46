"""The host's memory, and a run whose state cannot fit in it refused before its weights load.

On a CPU the devices' memory is the host's. A model whose parameters, optimizer state and
gradients alone exceed the machine would read its weights for minutes and then be killed
(or swap for hours). `check_fits` says so first, from the state's shapes alone, naming
each part and where the limit was read; `train --dry-run` prints the whole plan.

Example:
  >>> check_fits({"parameters": 2 << 30, "optimizer state": 4 << 30}, limit=(4 << 30, "test"))
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.ConfigError: this run's state needs at least 6.00 GiB of host memory (parameters 2.00 GiB, optimizer state 4.00 GiB) before any activations, more than the 4.00 GiB this host has (test); on a CPU the devices' memory is the host's. Train LoRA adapters over a frozen base (finetune.lora.rank=16), a smaller model, or on a larger machine; `jax-ai-stack train ... --dry-run` prints the whole plan
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.byte_sizes import format_bytes

MEMINFO = pathlib.Path("/proc/meminfo")
CGROUP_LIMITS = (pathlib.Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
                 pathlib.Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))  # v1


def host_memory(meminfo: pathlib.Path = MEMINFO,
                cgroup_limits: tuple[pathlib.Path, ...] = CGROUP_LIMITS
                ) -> tuple[int, str] | None:
  """(bytes, where read) of the memory this process may use: the smaller of the machine's
  (MemTotal) and its control group's limit; None where neither can be read."""
  found = []
  try:
    for line in meminfo.read_text().splitlines():
      if line.startswith("MemTotal:"):
        found.append((int(line.split()[1]) * 1024, f"{meminfo}'s MemTotal"))
  except (OSError, ValueError, IndexError):
    pass
  for path in cgroup_limits:
    try:
      text = path.read_text().strip()
    except OSError:
      continue
    if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit.
      found.append((int(text), str(path)))
  return min(found) if found else None


def check_fits(parts: Mapping[str, int], *, processes: int = 1,
               limit: tuple[int, str] | None = None) -> None:
  """Raises ConfigError if `parts` (the whole state's bytes by name, over all hosts, split
  evenly between `processes`) exceed the host's memory (`limit`, default `host_memory()`);
  nothing where the host does not say."""
  limit = host_memory() if limit is None else limit
  needed = sum(parts.values()) // max(processes, 1)
  if limit is None or needed <= limit[0]:
    return
  listed = ", ".join(f"{name} {format_bytes(n // max(processes, 1))}"
                     for name, n in parts.items())
  raise ConfigError(
      f"this run's state needs at least {format_bytes(needed)} of host memory ({listed}) "
      f"before any activations, more than the {format_bytes(limit[0])} this host has "
      f"({limit[1]}); on a CPU the devices' memory is the host's. Train LoRA adapters over a "
      "frozen base (finetune.lora.rank=16), a smaller model, or on a larger machine; "
      "`jax-ai-stack train ... --dry-run` prints the whole plan")

