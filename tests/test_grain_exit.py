"""A script that leaves its pipeline's iterators open exits quietly (`data.grain_exit`)."""

from __future__ import annotations

import pytest

from multidevice import run_program


@pytest.mark.parametrize("workers, take", [
    (0, "two_iterators"),  # next(iter(ds)) twice
    (0, "held"),  # iterator = iter(ds), alive at exit
    (0, "mapped"),  # a user's stage on top
    (2, "held"),  # mp_prefetch
])
def test_a_script_that_does_not_close_its_iterator_exits_quietly(workers, take):
  # Grain's prefetch iterator, closed by the garbage collector during shutdown,
  # printed "Exception ignored in ... DatasetIterator.__del__"; build_dataset
  # closes iterators still open in an atexit hook.
  result = run_program("iterator_left_open", workers, take, timeout=120, check=False)
  assert result.returncode == 0 and result.stdout == "done\n", result.stderr
  assert result.stderr == ""
