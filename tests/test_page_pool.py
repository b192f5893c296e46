"""The engine's page pool: pages held and given back, prompt chunks kept, reused, evicted."""

from __future__ import annotations

import pytest

from jax_ai_stack.recipes.inference.page_pool import PagePool, chunk_keys


def test_a_chunk_s_key_depends_on_its_tokens_and_every_token_before_them():
  a = chunk_keys((1, 2, 3, 4, 5, 6, 7), chunk=3)
  assert len(a) == 2  # Whole chunks only: the 7th token is in none.
  b = chunk_keys((1, 2, 3, 4, 5, 6), chunk=3)
  c = chunk_keys((9, 2, 3, 4, 5, 6), chunk=3)
  assert a == b and c[0] != a[0] and c[1] != a[1]  # The same second chunk after another first.
  assert chunk_keys((1, 2), chunk=3) == []


def test_pages_go_out_free_first_and_come_back_free_when_not_kept():
  pool = PagePool(4, chunk_pages=1)
  assert pool.take(2) == [1, 2] and pool.held == 2 and pool.available == 2
  pool.give_back([1, 2])
  assert pool.held == 0 and pool.available == 4 and pool.kept_pages == 0
  assert pool.take(4) == [1, 2, 3, 4]  # The order pages came back in: page 1 first again.


def test_a_kept_chunk_is_shared_while_held_and_waits_for_reuse_once_given_back():
  pool = PagePool(6, chunk_pages=2)
  first = pool.take(4)
  keys = chunk_keys(tuple(range(8)), chunk=4)
  pool.keep(keys, first, 1)
  pool.keep(keys, first, 2)
  pool.keep(keys, first, 3)  # No third chunk: nothing kept.
  second = pool.reuse(keys)  # Another request with the same 8 tokens, while the first runs.
  assert second == first and pool.held == 4 and pool.available == 2
  pool.give_back(first)
  assert pool.held == 4  # Still the second's: nothing to evict.
  with pytest.raises(KeyError):
    pool.take(3)
  pool.give_back(second)
  assert pool.held == 0 and pool.available == 6 and pool.kept_pages == 4
  assert pool.reusable(keys) == 2 and pool.reusable(keys[1:]) == 1
  assert pool.reusable(chunk_keys(tuple(range(1, 9)), chunk=4)) == 0


def test_eviction_takes_the_least_recently_used_chunk_and_a_prompt_s_end_before_its_start():
  pool = PagePool(4, chunk_pages=1)
  pages = pool.take(4)
  keys = chunk_keys(tuple(range(4)), chunk=1)
  for whole in range(1, 5):
    pool.keep(keys, pages, whole)
  pool.give_back(pages)
  assert pool.reusable(keys) == 4
  pool.take(1)  # The last chunk goes first: what is left is still a prefix.
  assert pool.reusable(keys) == 3
  pool.give_back(pool.reuse(keys[:1]))  # The first chunk used again: now the most recent.
  pool.take(2)
  assert pool.reusable(keys) == 1 and pool.kept_pages == 1
  assert pool.available == 1  # The first chunk's page, idle: the count follows evictions.


def test_a_request_fits_when_the_pages_it_does_not_reuse_are_available():
  pool = PagePool(4, chunk_pages=2)
  pages = pool.take(2)
  key = chunk_keys((7, 7), chunk=2)[0]
  pool.keep([key], pages, 1)
  pool.give_back(pages)
  # 4 pages, 2 of them the kept chunk: reusing it, 4 fit; without it, 4 fit only by evicting.
  assert pool.fits([key], 4) and pool.fits([], 4) and not pool.fits([], 5)
  assert not pool.fits([key], 5)
  assert pool.take(2) == [3, 4]  # The free ones: the chunk stays.
  assert pool.fits([key], 2) and not pool.fits([key], 3)  # Its own pages are no room for it.
  assert pool.fits([], 2) and not pool.fits([], 3)  # Another request's room, by evicting it.


def test_a_chunk_kept_twice_keeps_the_first_pages():
  pool = PagePool(4, chunk_pages=2)
  first, second = pool.take(2), pool.take(2)
  key = chunk_keys((1, 1), chunk=2)[0]
  pool.keep([key], first, 1)
  pool.keep([key], second, 1)  # Prefilled by two requests at once.
  pool.give_back(second)
  assert pool.kept_pages == 2 and pool.available == 2  # The second's pages are free again.
  pool.give_back(first)
  assert pool.reuse([key]) == first
