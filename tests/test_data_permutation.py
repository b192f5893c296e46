"""The stateless train order: a permutation per (seed, epoch), computed per position."""

from __future__ import annotations

import numpy as np
import pytest

from jax_ai_stack.recipes.data import epoch_permutation, permute

# Primes, powers of two and their neighbours (4**8 + 1 = 65537 is where Grain's
# index_shuffle repeats an index), and 1.
SIZES = [1, 2, 3, 4, 5, 7, 10, 13, 64, 97, 127, 128, 129, 1000, 4099, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_each_order_is_a_permutation_of_the_range(n):
  for seed in (0, 1, -3, 2**70):
    for epoch in (0, 1, 1000):
      order = epoch_permutation(n, seed, epoch)
      assert order.dtype == np.int64
      np.testing.assert_array_equal(np.sort(order), np.arange(n))


def test_seeds_and_epochs_give_different_orders():
  orders = {tuple(epoch_permutation(100, seed, epoch)) for seed in range(5) for epoch in range(5)}
  assert len(orders) == 25
  assert tuple(range(100)) not in orders


def test_order_is_deterministic_and_fixed_integer_arithmetic():
  # Golden value: the same on every machine and NumPy version (checked on 2.4 and 2.5).
  assert epoch_permutation(10, 0, 0).tolist() == [9, 4, 2, 6, 7, 8, 5, 3, 1, 0]
  assert epoch_permutation(10**6 + 3, 7, 2)[:4].tolist() == [
      int(i) for i in permute(np.arange(4), 10**6 + 3, 7, 2)]
  np.testing.assert_array_equal(epoch_permutation(1000, 5, 3), epoch_permutation(1000, 5, 3))


def test_one_position_at_a_time_equals_the_batch():
  n, seed, epoch = 10**9 + 7, 11, 4
  positions = np.random.default_rng(0).integers(0, n, 200)
  batch = permute(positions, n, seed, epoch)
  one_by_one = [int(permute(np.array([p]), n, seed, epoch)[0]) for p in positions]
  assert batch.tolist() == one_by_one
  assert permute(positions.reshape(20, 10), n, seed, epoch).shape == (20, 10)
  assert len(set(batch.tolist())) == 200 and batch.min() >= 0 and batch.max() < n


def test_order_is_not_close_to_the_identity():
  n = 10000
  order = epoch_permutation(n, 1, 0)
  assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.05
  assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.05  # neighbours are unrelated
  assert abs(np.corrcoef(order, epoch_permutation(n, 1, 1))[0, 1]) < 0.05


@pytest.mark.parametrize("positions, n", [([-1], 5), ([5], 5), ([0], 0)])
def test_positions_outside_the_range_are_refused(positions, n):
  with pytest.raises(ValueError):
    permute(np.array(positions), n, 0, 0)
