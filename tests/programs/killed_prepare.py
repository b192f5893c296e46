"""A token cache's prepare that SIGKILLs itself at one shard's stage: a process of its own to kill.

argv: the corpus's glob, the cache folder, [shard, stage] to die at (JSON), the workers (JSON)."""

import json
import os
import signal
import sys

from jax_ai_stack.recipes.data import DataConfig, token_cache


def on_shard(shard, stage):
  if [shard, stage] == stop_at:
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":  # spawned workers import this script again
  pattern, cache, stop_at, workers = (sys.argv[1], sys.argv[2], json.loads(sys.argv[3]),
                                      json.loads(sys.argv[4]))
  config = DataConfig(source="text", paths=(pattern,))
  token_cache.prepare(config, cache, shard_documents=5, chunk_tokens=64, read_block_tokens=16,
                      progress=False, on_shard=on_shard, workers=workers)
