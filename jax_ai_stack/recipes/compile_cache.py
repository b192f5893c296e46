"""A persistent XLA compilation cache for the command line, and compile timings.

A second run of the same recipe (or a resume) compiles the same programs
again: on a small CPU that is most of the wait for the first step. JAX can keep
compiled executables on disk (`jax_compilation_cache_dir`); `enable` turns that
on for `jax-ai-stack train`, `eval` and `generate`, before their first compile.

It is the command line's choice, not the package's: importing jax_ai_stack (or
calling `Trainer.open` from a notebook) changes no JAX setting. A library user
opts in with `enable("auto")`, or with JAX's own `JAX_COMPILATION_CACHE_DIR`.

The setting (`train.compile_cache`):

  "auto"       $JAX_COMPILATION_CACHE_DIR if set, else
               $XDG_CACHE_HOME/jax-ai-stack/xla (default ~/.cache/jax-ai-stack/xla)
  "off" or ""  no persistent cache (also when JAX_ENABLE_COMPILATION_CACHE=false)
  a path       that directory (created if missing)

The cache is trusted code: as JAX warns, anyone who can write to it can make
the process run what they like, so it lives in the user's own cache directory.
A cached executable is the very program the compiler produced, so a warm run
gives the same bits as a cold one.

Example:
  >>> resolve_dir("off") is None
  True
  >>> str(resolve_dir("auto", environ={"XDG_CACHE_HOME": "/c"}))
  '/c/jax-ai-stack/xla'
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import pydantic

from jax_ai_stack.errors import ConfigError

AUTO = "auto"
OFF = ("off", "")

Setting = Annotated[str, pydantic.BeforeValidator(lambda v: "off" if v is False else v)]
"""The config field's type: YAML reads a bare `off` as false, which means "off" here."""
SUBDIR = pathlib.Path("jax-ai-stack") / "xla"

MIN_COMPILE_TIME_S = 0.0
"""Cache every program, however quick to compile: besides the train step, the
initialisation, eval step and sampling programs each take seconds on a busy
2-core CPU but can stay under JAX's default threshold (1 s) on a faster one.
Entries are small: a whole lm-tiny run leaves 9, 0.8 MB in all."""


def resolve_dir(setting: str, environ: Mapping[str, str] = os.environ) -> pathlib.Path | None:
  """The cache directory `setting` names (see the module docstring); None: off."""
  setting = setting.strip()
  if setting.lower() in OFF:
    return None
  if environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in ("0", "false", "off", "no"):
    return None
  if setting != AUTO:
    return pathlib.Path(setting).expanduser()
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return pathlib.Path(environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
  base = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base).expanduser() / SUBDIR


def enable(setting: str = AUTO, environ: Mapping[str, str] = os.environ) -> pathlib.Path | None:
  """Points JAX's persistent cache at `resolve_dir(setting)`; returns it (None: off).

  Call before the first compile that should be cached. "off" also turns off a
  cache that `JAX_COMPILATION_CACHE_DIR` would have enabled.

  Raises:
    ConfigError: the directory cannot be created (names `train.compile_cache`).
  """
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc

  path = resolve_dir(setting, environ)
  if path is not None:
    try:
      path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ConfigError(
          f"train.compile_cache: cannot create the compilation cache directory {path}: "
          f"{e.strerror or e}; set another path, or 'off'") from None
  now = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
  wanted = (True, str(path)) if path is not None else (False, now[1])
  if now != wanted:
    jax.config.update("jax_enable_compilation_cache", wanted[0])
    jax.config.update("jax_compilation_cache_dir", wanted[1])
    # JAX decides once per process, at its first compile, whether and where it
    # caches; a change after that takes a reset.
    cc.reset_cache()
  if path is None:
    return None
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:  # The user's own wins.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in environ:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: any size.
  return path


def active_dir() -> str | None:
  """The persistent cache JAX uses in this process now; None: none."""
  import jax

  enabled = jax.config.jax_enable_compilation_cache
  return (jax.config.jax_compilation_cache_dir or None) if enabled else None


def count_entries(path: str | pathlib.Path) -> int:
  """Executables stored in a cache directory (JAX writes one `*-cache` file each)."""
  path = pathlib.Path(path)
  return sum(1 for p in path.iterdir() if p.name.endswith("-cache")) if path.is_dir() else 0


_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_VERBS = {_TRACE_EVENTS[0]: ("tracing", "traced"), _TRACE_EVENTS[1]: ("lowering", "lowered"),
          _COMPILE_EVENT: ("compiling", "compiled")}


@dataclasses.dataclass
class CompileTimes:
  """What JAX reported while the block ran: trace and compile seconds, cache hits.

  Listens to `jax.monitoring` events (the same names in jax 0.10 and 0.12);
  trace includes lowering to StableHLO; compile is XLA's backend compile, which
  a cache hit skips. `announce` (`progress.Wait`, or any function of a text returning
  something with `close(done)`): each trace, lowering and compile is announced with it
  as it starts (from JAX's start events), and closed with how long it took, by JAX's
  own duration, and whether the persistent cache served it: a long start-up is never
  silent, and no second timer measures what JAX measures.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> with CompileTimes() as times:
    ...   _ = jax.jit(lambda x: x * 3)(jnp.ones(2))
    >>> times.compile_s > 0
    True
  """

  trace_s: float = 0.0
  compile_s: float = 0.0
  compiles: int = 0
  cache_hits: int = 0
  cache_misses: int = 0
  announce: Callable[[str], Any] | None = None
  _waits: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def startup_line(self, import_s: float | None, init_s: float, first_step_s: float) -> str:
    """Where the wait for the first step went: import, init, trace, compile, cache hits."""
    imported = f"import {import_s:.1f} s, " if import_s is not None else ""
    cache = active_dir()
    hits = f"{self.cache_hits} loaded from the cache {cache}" if cache else "no persistent cache"
    return (f"start-up: {imported}init {init_s:.1f} s (data, model, checkpoint), "
            f"first step after {first_step_s:.1f} s; of which trace {self.trace_s:.1f} s, "
            f"compile {self.compile_s:.1f} s ({self.compiles} programs, {hits})")

  def _on_start(self, event: str, value: float, **kwargs) -> None:
    """JAX's start of a trace, lowering or compile (`log_elapsed_time` records its start
    time as a scalar)."""
    del value
    if event in _VERBS:
      name = kwargs.get("fun_name", "a program")
      self._waits.setdefault((event, name), []).append(
          [self.announce(f"{_VERBS[event][0]} {name}"), False])  # [wait, cache hit]

  def _done(self, event: str, duration: float, name: str) -> None:
    waits = self._waits.get((event, name))
    if not waits:
      return
    wait, hit = waits.pop()
    served = ""
    if event == _COMPILE_EVENT:
      served = (" (loaded from the compilation cache)" if hit else
                " (not in the compilation cache)" if active_dir() else "")
    wait.close(f"{_VERBS[event][1]} {name} in {duration:.1f} s{served}")

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if self.announce is not None:
      self._done(event, duration, kwargs.get("fun_name", "a program"))
    if event in _TRACE_EVENTS:
      self.trace_s += duration
    elif event == _COMPILE_EVENT:
      self.compile_s += duration
      self.compiles += 1

  def _on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event == _HIT_EVENT:
      self.cache_hits += 1
      for (kind, _), waits in self._waits.items():  # The compile open now was served.
        if kind == _COMPILE_EVENT and waits:
          waits[-1][1] = True
    elif event == _MISS_EVENT:
      self.cache_misses += 1

  _listening: bool = dataclasses.field(default=False, repr=False, compare=False)

  def start(self) -> CompileTimes:
    """Starts listening; `stop` (or leaving a `with` block) ends it."""
    import jax

    if not self._listening:
      jax.monitoring.register_event_duration_secs_listener(self._on_duration)
      jax.monitoring.register_event_listener(self._on_event)
      if self.announce is not None:
        jax.monitoring.register_scalar_listener(self._on_start)
      self._listening = True
    return self

  def stop(self) -> None:
    """Stops listening; the figures stay. Calling it again does nothing."""
    import jax

    if self._listening:
      jax.monitoring.unregister_event_duration_listener(self._on_duration)
      jax.monitoring.unregister_event_listener(self._on_event)
      if self.announce is not None:
        jax.monitoring.unregister_scalar_listener(self._on_start)
        for waits in self._waits.values():  # Left open by an exception.
          for wait, _ in waits:
            wait.close()
        self._waits.clear()
      self._listening = False

  def __enter__(self) -> CompileTimes:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
