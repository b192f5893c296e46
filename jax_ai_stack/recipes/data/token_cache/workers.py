"""Tokenizing a cache's documents, a shard at a time, in this process or in spawned workers.

With `workers=N` this process reads the documents and N spawned processes
tokenize them, a shard per task; shards come back strictly in order, so the
cache is byte-identical to one of a single process, and at most 2N shards are
in flight, so memory stays bounded. Workers ignore Ctrl-C (the parent answers
it) and end when their parent is gone.

Example:
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> config = DataConfig(source="text", paths=("*.txt",))
  >>> shards = _shards(config, build_tokenizer(config), skip=0, shard_documents=1, workers=1)
  >>> [shard.lengths.tolist() for shard in shards]
  [[5], [7]]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import resource_tracker

import numpy as np

from jax_ai_stack.recipes.data import corpus as corpus_lib
from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.token_cache.store import _DIGEST_BYTES
from jax_ai_stack.recipes.data.tokenizers import Tokenizer, build_tokenizer


@dataclasses.dataclass(frozen=True)
class _Shard:
  """One shard's documents as the arrays store them (what a worker sends back)."""

  lengths: np.ndarray  # int64 [documents]
  tokens: np.ndarray  # the cache's dtype [sum(lengths)]
  digests: np.ndarray  # uint8 [documents, 16]


def _pack(documents: list[tuple[bytes, np.ndarray]], dtype: np.dtype) -> _Shard:
  return _Shard(
      lengths=np.array([len(ids) for _, ids in documents], dtype=np.int64),
      tokens=np.concatenate([ids for _, ids in documents]).astype(dtype),
      digests=np.frombuffer(
          b"".join(corpus_lib.document_digest(content) for content, _ in documents), np.uint8
      ).reshape(-1, _DIGEST_BYTES),
  )


# Each worker process's tokenizer, built once there by `_start_worker`.
_worker_tokenizer: Tokenizer | None = None


@contextlib.contextmanager
def _deaf_to_ctrl_c():
  """Processes started in the block never see SIGINT; here it waits until the block ends.

  Ctrl-C reaches the terminal's whole process group: the parent answers it (one
  line, exit 130) and its workers end with it (`_exit_without`), but a worker
  interrupted, even while still importing, would print its own traceback. A
  blocked signal mask is inherited through fork and exec; Python's handler in
  this process runs once the block ends.
  """
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_quiet_resource_tracker() -> None:
  """multiprocessing's resource tracker, without its warning after a Ctrl-C.

  It outlives a prepare stopped by Ctrl-C by a moment and warns about the pool's
  semaphores, which it then removes itself; its flags come from
  `sys.warnoptions` when it starts. Nothing happens if it is already running.
  """
  saved = sys.warnoptions[:]
  sys.warnoptions.append("ignore:resource_tracker:UserWarning")
  try:
    resource_tracker.ensure_running()
  finally:
    sys.warnoptions[:] = saved


def _start_worker(config: DataConfig, parent: int) -> None:
  global _worker_tokenizer
  _worker_tokenizer = build_tokenizer(config)
  threading.Thread(target=_exit_without, args=(parent,), daemon=True).start()


def _exit_without(parent: int) -> None:
  """Ends this worker once `parent` is gone: a killed prepare leaves no orphans
  (workers hold both ends of their task queue, so they never see it close)."""
  while os.getppid() == parent:
    time.sleep(0.5)
  os._exit(1)


def _tokenize_shard(texts: list[str], dtype: np.dtype) -> _Shard:
  return _pack(corpus_lib.tokenize_texts(_worker_tokenizer, texts), dtype)


def _shards(config: DataConfig, tokenizer: Tokenizer, *, skip: int, shard_documents: int,
            workers: int) -> Iterator[_Shard]:
  """The shards after the first `skip` documents, in order, tokenized in `workers` processes.

  Worker processes are spawned, not forked: TensorStore's threads are running
  here. `.npy` sources need no tokenizing and are read here whatever `workers`.
  """
  dtype = corpus_lib.token_dtype(tokenizer)
  if workers == 1 or config.source == "npy":
    documents = corpus_lib.tokenized_documents(config, tokenizer, skip=skip)
    while batch := list(itertools.islice(documents, shard_documents)):
      yield _pack(batch, dtype)
    return
  texts = corpus_lib.document_texts(config, skip=skip)
  with _deaf_to_ctrl_c():
    _start_quiet_resource_tracker()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(config, os.getpid()))
  pending = collections.deque()
  try:
    while True:
      while len(pending) < 2 * workers and (batch := list(itertools.islice(texts,
                                                                           shard_documents))):
        with _deaf_to_ctrl_c():  # The pool starts its workers here.
          pending.append(pool.submit(_tokenize_shard, batch, dtype))
      if not pending:
        return
      yield pending.popleft().result()
  finally:
    pool.shutdown(cancel_futures=True)

