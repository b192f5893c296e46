"""Many processes, one training job: `jax.distributed`, joined from the command line.

JAX runs the same program in every process (usually one per host); each owns
its local devices, and together they form the global mesh that `sharding` lays
the state and the batches out on. Nothing here starts processes: the cluster
(a TPU pod slice, SLURM, Open MPI, Kubernetes) or the user starts one per host
with the same command, and `initialize` connects them before anything touches a
device. How the processes meet is a fact of the launch, not of the recipe, so
it lives in flags (`jax-ai-stack train --distributed auto`), not in the config.

JAX aborts the whole process (no Python exception) when it cannot reach the
coordinator or bind its port, so `initialize` checks both itself first and
raises `DistributedError` naming the address instead.

Example:
  >>> launch = Launch.from_flags("explicit", coordinator="10.0.0.1:1234",
  ...                            num_processes=2, process_id=1)
  >>> launch.describe()
  'process 1 of 2, coordinator 10.0.0.1:1234'
  >>> Launch.from_flags(None).mode
  'off'
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import time
from typing import Literal

from jax_ai_stack.errors import UsageError, UserError

DEFAULT_TIMEOUT_S = 120
"""How long a process waits for the others (and the coordinator) to show up."""

Mode = Literal["off", "auto", "explicit"]


class DistributedError(UserError):
  """The processes of a job could not connect; names the address and the flags."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process joins the job.

  `off`: one process (the default). `auto`: `jax.distributed.initialize()`
  reads the cluster's environment (TPU pod slices, SLURM, Open MPI,
  Kubernetes with JAX's environment variables). `explicit`: the coordinator
  address, the number of processes and this process's id are given.
  """

  mode: Mode = "off"
  coordinator: str | None = None
  """HOST:PORT of process 0, which runs the coordination service."""
  num_processes: int | None = None
  process_id: int | None = None
  timeout_s: int = DEFAULT_TIMEOUT_S

  @classmethod
  def from_flags(cls, distributed: str | None, *, coordinator: str | None = None,
                 num_processes: int | None = None, process_id: int | None = None,
                 timeout_s: int | None = None) -> Launch:
    """The launch the flags describe; `UsageError` when they do not fit together."""
    explicit = {"--coordinator": coordinator, "--num-processes": num_processes,
                "--process-id": process_id}
    given = [flag for flag, value in explicit.items() if value is not None]
    mode = distributed or ("explicit" if given else "off")
    if mode not in ("off", "auto", "explicit"):
      raise UsageError(f"--distributed must be off, auto or explicit, got {mode!r}")
    if mode == "explicit" and len(given) != len(explicit):
      missing = [flag for flag in explicit if flag not in given]
      raise UsageError(f"a distributed launch needs {', '.join(explicit)}; missing: "
                       f"{', '.join(missing)} (or use --distributed auto on a cluster)")
    if mode != "explicit" and given:
      raise UsageError(f"{', '.join(given)} given with --distributed {mode}: drop them, "
                       "or use --distributed explicit")
    if timeout_s is not None and timeout_s < 1:
      raise UsageError(f"--distributed-timeout must be >= 1 second, got {timeout_s}")
    launch = cls(mode, coordinator, num_processes, process_id, timeout_s or DEFAULT_TIMEOUT_S)
    if mode == "explicit":
      launch._check_explicit()
    return launch

  def _check_explicit(self) -> None:
    _host_port(self.coordinator)
    if self.num_processes < 1:
      raise UsageError(f"--num-processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise UsageError(f"--process-id must be in [0, {self.num_processes}) for "
                       f"--num-processes {self.num_processes}, got {self.process_id}")

  def describe(self) -> str:
    if self.mode == "explicit":
      return (f"process {self.process_id} of {self.num_processes}, "
              f"coordinator {self.coordinator}")
    return {"off": "one process", "auto": "processes found by jax.distributed"}[self.mode]


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UsageError(f"--coordinator must be HOST:PORT, got {address!r}")
  return host.strip("[]"), int(port)


def initialize(launch: Launch) -> None:
  """Joins the job (call before any JAX computation); does nothing when `off`."""
  if launch.mode == "off":
    return
  import jax

  if launch.mode == "auto":
    try:
      jax.distributed.initialize(initialization_timeout=launch.timeout_s)
    except ValueError as e:  # No cluster found in the environment.
      raise DistributedError(
          f"--distributed auto found no cluster to join ({e}); on TPU pods, SLURM, Open MPI "
          "and Kubernetes JAX reads it from the environment. Elsewhere give --coordinator "
          "HOST:PORT --num-processes N --process-id I") from None
    return
  host, port = _host_port(launch.coordinator)
  if launch.num_processes > 1:
    if launch.process_id == 0:
      _check_port_free(port, launch.coordinator)
    else:
      _wait_for_coordinator(host, port, launch)
  print(f"joining the job: {launch.describe()} ...", file=sys.stderr, flush=True)
  jax.distributed.initialize(
      coordinator_address=launch.coordinator, num_processes=launch.num_processes,
      process_id=launch.process_id, initialization_timeout=launch.timeout_s)


def _check_port_free(port: int, address: str) -> None:
  """Process 0 serves the coordinator on every interface: its port must be free."""
  with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("", port))
    except OSError as e:
      raise DistributedError(
          f"process 0 cannot serve the coordinator at {address}: port {port} is not free "
          f"({e.strerror or e}); choose another --coordinator port") from None


def _wait_for_coordinator(host: str, port: int, launch: Launch) -> None:
  """Waits until process 0's coordinator accepts connections, or raises after the timeout."""
  deadline = time.monotonic() + launch.timeout_s
  while True:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
      return
    if time.monotonic() >= deadline:
      raise DistributedError(
          f"process {launch.process_id} could not reach the coordinator at "
          f"{launch.coordinator} within {launch.timeout_s}s: is process 0 running with the "
          "same --coordinator, and is the port open between the hosts? "
          "(--distributed-timeout sets the wait)")
    time.sleep(0.5)


def is_primary() -> bool:
  """Whether this process writes the run's shared files (metrics, plot, sample)."""
  import jax

  return jax.process_index() == 0
