"""A script that leaves its pipeline's iterators open exits quietly (`data.grain_exit`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("workers, take", [
    (0, "next(iter(ds)); next(iter(ds))"),
    (0, "iterator = iter(ds); next(iterator); next(iterator)"),  # alive at exit
    (0, "iterator = iter(ds.map(lambda b: b)); next(iterator)"),  # a user's stage on top
    (2, "iterator = iter(ds); next(iterator); next(iterator)"),  # mp_prefetch
])
def test_a_script_that_does_not_close_its_iterator_exits_quietly(workers, take):
  # Grain's prefetch iterator, closed by the garbage collector during shutdown,
  # printed "Exception ignored in ... DatasetIterator.__del__"; build_dataset
  # closes iterators still open in an atexit hook.
  script = textwrap.dedent(f"""
      from jax_ai_stack.recipes.data import DataConfig, build_dataset
      config = DataConfig(max_documents=40, seq_len=16, batch_size=4, num_workers={workers})
      ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
      {take}
      print("done")
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0 and result.stdout == "done\n", result.stderr
  assert result.stderr == ""
