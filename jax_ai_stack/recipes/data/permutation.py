"""Stateless shuffles and hashes: an order that is a pure function of (seed, epoch, index).

The train order must survive a restart from nothing but the step number, be
the same on every host, NumPy version and machine, and cost nothing per epoch
whatever the dataset size. So position p of epoch e holds example
`permute(p, n, seed, e)`, one value of a pseudorandom permutation of
`range(n)` that is computed per position and never stored: O(1) memory, no
sort, and a batch of positions is one vectorised call.

The permutation is a Feistel network on mixed radix (as in format-preserving
encryption): x in [0, a*b) is the pair (x // b, x % b) with a = ceil(sqrt(n))
and b = ceil(n / a), and each round adds, modulo its radix, a SplitMix64 hash
of the other half and a round key to one half. Each round is undone by
subtracting, so the network is a bijection of [0, a*b). Since a*b < n + a, a
value that lands at or beyond n is rare (about 1/sqrt(n) of them); it is
encrypted again until it falls inside ("cycle walking"), which keeps a
bijection of range(n) because each cycle of the big permutation comes back
into range(n) at the latest at its own start. Everything is uint64 integer
arithmetic that wraps mod 2**64: the same bits on every NumPy version.

Why not `grain.experimental.index_shuffle`: in grain 0.2.18 it is not a
permutation when `max_index` is 4**8, 4**9 or 4**10 (n = 65537, 262145 or
1048577 repeat one index and never reach n - 1), and it maps one Python int
per call: about 4 us each, so 0.25 ms for a batch of 64 and 1 ms for 256,
where `permute` takes about 50, 50 and 70 us (30 us against 50 us for 8).

Example:
  >>> epoch_permutation(10, seed=0, epoch=0).tolist()
  [9, 4, 2, 6, 7, 8, 5, 3, 1, 0]
  >>> permute(np.array([0, 1, 2]), 10, seed=0, epoch=0).tolist()
  [9, 4, 2]
"""

from __future__ import annotations

import functools
import math

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: spreads counters
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
# Rounds, each rewriting one digit. Three make a pseudorandom permutation of a
# large domain (Luby-Rackoff); tiny n (a few examples) need more to make their
# orders close to uniform over all n! (8: chi-square/dof 0.5 at n=4, 2.9 at n=5).
_ROUNDS = 8


def _mix(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer on a uint64 array (array ops wrap without warnings)."""
  x = (x ^ (x >> _S30)) * _MIX1
  x = (x ^ (x >> _S27)) * _MIX2
  return x ^ (x >> _S31)


def mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer on uint64: a fixed bijective hash (wraps mod 2**64)."""
  with np.errstate(over="ignore"):  # NumPy scalars warn on wrapping; arrays do not
    return _mix(x)


def _uint64(value: int) -> np.ndarray:
  """Any Python int as a one-element uint64 array (two's complement for negatives)."""
  return np.array([value & _MASK64], dtype=np.uint64)


def hash_uniform(values: np.ndarray, salt: int) -> np.ndarray:
  """float64 in [0, 1) per integer in `values`, fixed by (value, salt).

  Example:
    >>> hash_uniform(np.arange(3), salt=7).round(3).tolist()
    [0.717, 0.846, 0.505]
  """
  key = mix64(_uint64(salt))
  with np.errstate(over="ignore"):
    hashed = mix64(np.asarray(values).astype(np.uint64) * _GOLDEN ^ key)
  return (hashed >> np.uint64(11)).astype(np.float64) / 2.0**53


@functools.lru_cache(maxsize=16)
def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
  """One uint64 key per round, fixed by (seed, epoch)."""
  base = _mix(_mix(_uint64(seed)) + _uint64(epoch) * _GOLDEN)
  return tuple(_mix(base + np.arange(1, _ROUNDS + 1, dtype=np.uint64) * _GOLDEN))


def _radices(num_examples: int) -> tuple[int, int]:
  """(a, b) with a = ceil(sqrt(n)), b = ceil(n / a): a*b >= n and a*b < n + a."""
  a = math.isqrt(num_examples - 1) + 1
  return a, -(-num_examples // a)


def _feistel(x: np.ndarray, a: int, b: int, keys) -> np.ndarray:
  """A bijection of [0, a*b) on uint64 `x`: rounds alternate between the two digits."""
  a, b = np.uint64(a), np.uint64(b)
  high, low = x // b, x % b
  for r, key in enumerate(keys):
    if r % 2 == 0:
      high = (high + _mix(low ^ key) % a) % a
    else:
      low = (low + _mix(high ^ key) % b) % b
  return high * b + low


def permute(positions: np.ndarray, num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example at each of `positions` in the (seed, epoch) order of range(num_examples).

  Args:
    positions: ints in [0, num_examples), any shape.
    num_examples: the size of the permuted range, >= 1.
    seed: any int (negative ones too).
    epoch: any int >= 0; each epoch has its own order.

  Returns:
    int64 example ids shaped like `positions`. A position gives the same id
    alone as in any batch: the order is a pure function of (seed, epoch,
    position), never of what was computed before.

  Raises:
    ValueError: num_examples < 1 or a position outside [0, num_examples).
  """
  if num_examples < 1:
    raise ValueError(f"num_examples must be >= 1, got {num_examples}")
  positions = np.asarray(positions, dtype=np.int64)
  if positions.size and (positions.min() < 0 or positions.max() >= num_examples):
    raise ValueError(f"positions must be in [0, {num_examples})")
  a, b = _radices(num_examples)
  keys = _round_keys(seed, epoch)
  out = _feistel(positions.astype(np.uint64), a, b, keys)
  outside = out >= num_examples
  while outside.any():  # cycle walking; ends within the cycle of each position
    out[outside] = _feistel(out[outside], a, b, keys)
    outside = out >= num_examples
  return out.astype(np.int64)


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The whole order of one epoch: `permute(arange(num_examples), ...)` (O(n); for tests)."""
  return permute(np.arange(num_examples), num_examples, seed, epoch)
