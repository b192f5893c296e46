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

A process that dies (SIGKILL, a lost host) stops the others within the
heartbeat timeout (`--heartbeat-timeout`, default 10 s; JAX's own is 100 s):
the coordination service reports it (or, when the coordinator itself died, the
connection to it fails at once), and JAX's runtime aborts the process. `PeerLost`
catches that abort: each survivor prints one line naming the process that
stopped answering and where the last checkpoint is, and exits
`PEER_LOST_EXIT_CODE`. Every checkpoint on disk is whole (Orbax commits a
step by renaming it), so the next start resumes from the last one.

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
import os
import pathlib
import socket
import sys
import time
from typing import Literal, NoReturn

from jax_ai_stack.errors import UsageError, UserError

DEFAULT_TIMEOUT_S = 120
"""How long a process waits for the others (and the coordinator) to show up."""

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
"""How long a process may go silent before the others stop (JAX's default: 100 s).

Heartbeats come from a background thread, so a long compile or a slow step
does not miss them; only a dead process, host or network does."""

PEER_LOST_EXIT_CODE = 69
"""EX_UNAVAILABLE: another process of the job stopped answering; restart the job."""

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
  """Seconds to wait for the other processes at start."""
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
  """Seconds of silence after which a process counts as dead and the job stops."""

  @classmethod
  def from_flags(cls, distributed: str | None, *, coordinator: str | None = None,
                 num_processes: int | None = None, process_id: int | None = None,
                 timeout_s: int | None = None,
                 heartbeat_timeout_s: int | None = None) -> Launch:
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
    if heartbeat_timeout_s is not None and heartbeat_timeout_s < 2:
      raise UsageError(f"--heartbeat-timeout must be >= 2 seconds, got {heartbeat_timeout_s}")
    launch = cls(mode, coordinator, num_processes, process_id, timeout_s or DEFAULT_TIMEOUT_S,
                 heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S)
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


def initialize(launch: Launch, *, checkpoints: str | os.PathLike | None = None) -> None:
  """Joins the job (call before any JAX computation); does nothing when `off`.

  Args:
    launch: how this process joins.
    checkpoints: the run's checkpoint directory, named (with its newest step)
      in the line printed when another process stops answering.
  """
  if launch.mode == "off":
    return
  import jax

  timeouts = dict(initialization_timeout=launch.timeout_s,
                  heartbeat_timeout_seconds=launch.heartbeat_timeout_s)
  if launch.mode == "auto":
    try:
      jax.distributed.initialize(**timeouts)
    except ValueError as e:  # No cluster found in the environment.
      raise DistributedError(
          f"--distributed auto found no cluster to join ({e}); on TPU pods, SLURM, Open MPI "
          "and Kubernetes JAX reads it from the environment. Elsewhere give --coordinator "
          "HOST:PORT --num-processes N --process-id I") from None
  else:
    host, port = _host_port(launch.coordinator)
    if launch.num_processes > 1:
      if launch.process_id == 0:
        _check_port_free(port, launch.coordinator)
      else:
        _wait_for_coordinator(host, port, launch)
    print(f"joining the job: {launch.describe()} ...", file=sys.stderr, flush=True)
    jax.distributed.initialize(
        coordinator_address=launch.coordinator, num_processes=launch.num_processes,
        process_id=launch.process_id, **timeouts)
  lost = PeerLost.joined(launch, checkpoints)
  if lost.num_processes > 1:
    _stop_on_runtime_abort(lost)


@dataclasses.dataclass(frozen=True)
class PeerLost:
  """The line a process prints when the job lost one of its processes.

  JAX's runtime reacts to a lost process by aborting (SIGABRT, after its own
  log lines): at once when the coordinator's connection fails, after the
  heartbeat timeout when the coordinator reports another process dead. The
  runtime's callback cannot be replaced from Python in the pinned versions (it
  is called with an `absl::Status` that nanobind cannot convert), so the abort
  itself is caught: this names the process that stopped answering (the
  coordinator when its port no longer answers; with two processes, the other
  one) and where the last checkpoint is, and exits `PEER_LOST_EXIT_CODE`.

  Example:
    >>> PeerLost(0, 2, "10.0.0.1:1234", 10).message(coordinator_answers=True)[:58]
    'process 1 of 2 stopped answering (heartbeat timeout 10 s);'
    >>> PeerLost(1, 2, "10.0.0.1:1234", 10).message(coordinator_answers=False)[:60]
    'process 0 of 2 (the coordinator, 10.0.0.1:1234) stopped answ'
  """

  process_id: int
  num_processes: int
  coordinator: str | None
  heartbeat_timeout_s: int
  checkpoints: str | os.PathLike | None = None

  @classmethod
  def joined(cls, launch: Launch, checkpoints: str | os.PathLike | None = None) -> PeerLost:
    """This process's place in the job `launch` joined (`auto`: as JAX found it)."""
    if launch.mode == "explicit":
      process_id, count, coordinator = launch.process_id, launch.num_processes, launch.coordinator
    else:
      from jax._src import distributed as jax_distributed  # Read without starting a backend.

      state = jax_distributed.global_state
      process_id, count, coordinator = (state.process_id, state.num_processes,
                                        state.coordinator_address)
    return cls(process_id, count, coordinator, launch.heartbeat_timeout_s, checkpoints)

  def message(self, *, coordinator_answers: bool) -> str:
    """The line, after the command's prefix; `coordinator_answers`: whether its port does."""
    heartbeat = f"heartbeat timeout {self.heartbeat_timeout_s} s"
    of = f"of {self.num_processes}"
    if self.process_id != 0 and not coordinator_answers:
      what = (f"process 0 {of} (the coordinator, {self.coordinator}) stopped answering "
              "(its connection closed)")
    elif self.process_id != 0 and self.num_processes == 2:
      what = (f"the coordinator reported this process (1 {of}) lost ({heartbeat}: was it "
              "stopped or starved?)")
    elif self.num_processes == 2:
      what = f"process 1 {of} stopped answering ({heartbeat})"
    else:
      what = (f"a process {of} stopped answering ({heartbeat}; process 0's log names it: "
              "'Task N heartbeat timeout')")
    return f"{what}; {self._kept()}start every process again to resume"

  def _kept(self) -> str:
    if self.checkpoints is None:
      return ""
    step = latest_saved_step(self.checkpoints)
    if step is None:
      return f"no checkpoint was saved yet in {self.checkpoints}; "
    return f"the last checkpoint (step {step}) is kept in {self.checkpoints}; "

  def coordinator_answers(self, timeout_s: float = 1.0) -> bool:
    """Whether process 0's coordinator port still accepts a connection."""
    if self.coordinator is None:
      return True
    try:
      host, port = _host_port(self.coordinator)
      with socket.create_connection((host, port), timeout=timeout_s):
        return True
    except (OSError, UsageError):
      return False

  def exit(self) -> NoReturn:
    """Prints the line (stdout flushed first) and ends the process, skipping JAX's abort."""
    try:
      answers = self.process_id == 0 or self.coordinator_answers()
      line = self.message(coordinator_answers=answers)
    except Exception as e:  # pylint: disable=broad-except  # Exit, whatever happens.
      line = f"a process of the job stopped answering ({e!r})"
    with contextlib.suppress(Exception):
      sys.stdout.flush()
    with contextlib.suppress(OSError):
      os.write(2, f"\njax-ai-stack train: error: {line}\n".encode(errors="replace"))
    os._exit(PEER_LOST_EXIT_CODE)  # pylint: disable=protected-access


def latest_saved_step(directory: str | os.PathLike) -> int | None:
  """The newest whole step in an Orbax checkpoint directory, read without Orbax.

  A step being written has a temporary name until Orbax renames it to its
  number, so a numbered directory is a finished one.
  """
  with contextlib.suppress(OSError):
    return max((int(p.name) for p in pathlib.Path(directory).iterdir()
                if p.name.isdigit() and p.is_dir()), default=None)
  return None


_abort_handler = None  # The C handler must outlive the call that installs it.


def _stop_on_runtime_abort(lost: PeerLost) -> None:
  """On SIGABRT (JAX's runtime aborting on a lost process), `lost.exit()` instead.

  A C-level handler (ctypes): Python's own `signal.signal` handler would run
  only after the abort had killed the process. The handler never returns, so
  the abort does not go on. Also, an exception raised by a collective that
  the lost process left (Gloo: "Connection closed by peer") waits for that
  verdict (up to the heartbeat timeout, and a few seconds) before it is
  reported as a bug with its traceback.
  """
  global _abort_handler
  import ctypes
  import signal

  handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
  handler = handler_type(lambda signum: lost.exit())
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, handler_type)
  except (OSError, AttributeError, TypeError):  # No C library to ask: JAX's abort stays.
    return
  libc.signal(signal.SIGABRT, handler)
  _abort_handler = handler
  previous_hook = sys.excepthook

  def wait_for_the_verdict(kind, value, traceback):
    if _is_runtime_error(value):
      time.sleep(lost.heartbeat_timeout_s + 5)  # The abort, if it comes, ends the process here.
    previous_hook(kind, value, traceback)

  sys.excepthook = wait_for_the_verdict


def _is_runtime_error(error: BaseException) -> bool:
  """Whether `error` came from JAX's runtime (a collective, a transfer), not our code."""
  if "Gloo" in str(error):  # Some paths re-raise the collective's error as a ValueError.
    return True
  with contextlib.suppress(ImportError, AttributeError):
    import jax

    return isinstance(error, jax.errors.JaxRuntimeError)
  return False


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
