"""Shared by the data tests: reading batches from `build_dataset` and comparing them."""

from __future__ import annotations

import numpy as np

from jax_ai_stack.recipes.data import build_dataset


def read_batches(config, count=None, **kwargs) -> list[dict]:
  """`count` batches (None: all of a finite split); the iterator is closed after."""
  kwargs = {"split": "train", "seed": 0, "process_index": 0, "process_count": 1, **kwargs}
  iterator = iter(build_dataset(config, **kwargs))
  try:
    return list(iterator) if count is None else [next(iterator) for _ in range(count)]
  finally:
    iterator.close()


def assert_same_batches(batches_a, batches_b) -> None:
  """Bitwise: the same keys, dtypes and values, batch by batch."""
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for key in a:
      assert a[key].dtype == b[key].dtype, key
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)
