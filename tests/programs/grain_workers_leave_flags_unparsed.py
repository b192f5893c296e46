"""Grain's workers, then the host's own flags: in a fresh interpreter nothing parsed them yet."""

import contextlib

from absl import flags

from jax_ai_stack.recipes.data import DataConfig, build_dataset

if __name__ == "__main__":  # Grain's spawned workers import this script again.
  config = DataConfig(max_documents=40, seq_len=16, batch_size=4, num_workers=1)
  ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  with contextlib.closing(iter(ds)) as iterator:
    print(next(iterator)["inputs"].shape, flags.FLAGS.is_parsed())
  flags.FLAGS(["prog", "--grain_py_debug_mode"])
  print(flags.FLAGS.grain_py_debug_mode)
