"""A pipeline's iterators left open: what a fresh interpreter prints as it exits is tested.

argv: the workers (JSON), how the batches are taken: two_iterators (each dropped at once),
held (one iterator, alive at exit) or mapped (a user's stage on top)."""

import json
import sys

from jax_ai_stack.recipes.data import DataConfig, build_dataset

if __name__ == "__main__":  # Grain's spawned workers import this script again.
  workers, how = json.loads(sys.argv[1]), sys.argv[2]
  config = DataConfig(max_documents=40, seq_len=16, batch_size=4, num_workers=workers)
  ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  if how == "two_iterators":
    next(iter(ds))
    next(iter(ds))
  elif how == "held":
    iterator = iter(ds)
    next(iterator)
    next(iterator)
  elif how == "mapped":
    iterator = iter(ds.map(lambda b: b))
    next(iterator)
  else:
    raise SystemExit(f"unknown way to take batches: {how!r}")
  print("done")
