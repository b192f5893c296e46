"""`data prepare` Ctrl-C'd once shard 1 is written: a process group of its own to signal.

argv: the corpus's glob, the cache folder."""

import os
import signal
import sys

from jax_ai_stack import cli
from jax_ai_stack.recipes.data import token_cache

real_prepare = token_cache.prepare


def prepare(*args, **kwargs):
  def on_shard(shard, stage):
    if (shard, stage) == (1, "written"):  # Ctrl-C: the terminal signals the whole group.
      os.killpg(0, signal.SIGINT)
  return real_prepare(*args, **{**kwargs, "on_shard": on_shard, "shard_documents": 5})


token_cache.prepare = prepare
if __name__ == "__main__":  # spawned workers import this script again
  pattern, cache = sys.argv[1], sys.argv[2]
  sys.exit(cli.main(["data", "prepare", "lm-tiny", "data.source=text",
                     f"data.paths=[{pattern}]", "--cache", cache, "--workers", "2"]))
