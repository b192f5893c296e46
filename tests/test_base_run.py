"""The base of a fine-tune: what `finetune.base` may name, and the checksum that guards it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack.recipes.finetune import base_run


def test_a_workdir_a_step_directory_and_a_checkpoint_directory_resolve(tmp_path):
  (tmp_path / "run" / "checkpoints" / "30").mkdir(parents=True)
  checkpoints = (tmp_path / "run" / "checkpoints").absolute()
  assert base_run.resolve_base(tmp_path / "run") == (checkpoints, None)
  assert base_run.resolve_base(checkpoints / "30") == (checkpoints, 30)
  assert base_run.resolve_base(checkpoints) == (checkpoints, None)


def test_a_directory_without_a_run_is_named(tmp_path):
  with pytest.raises(base_run.BaseCheckpointError, match=r"finetune.base='.*empty': no trained "
                     r"run there .* train the base first"):
    base_run.resolve_base(tmp_path / "empty")


def test_the_checksum_sees_one_changed_bit_and_a_reordering():
  weights = {"a": jnp.arange(6, dtype=jnp.float32), "b": jnp.ones((2, 2), jnp.bfloat16)}
  before = base_run.checksum(weights).tolist()
  assert base_run.checksum(dict(weights)).tolist() == before
  flipped = weights["a"].at[3].set(jnp.nextafter(weights["a"][3], 10.0))
  assert base_run.checksum({**weights, "a": flipped}).tolist() != before
  assert base_run.checksum({**weights, "a": weights["a"][::-1]}).tolist() != before


def _numpy_checksum(leaves) -> list[int]:
  """The checksum's definition: per leaf, sum((position * 2654435761 + 1) * bits) and
  sum((position + index) * bits) over its unsigned words, mod 2**32; total * 31 + sums."""
  total = np.zeros(2, np.uint64)
  for index, leaf in enumerate(leaves):
    leaf = np.asarray(leaf)
    words = leaf.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[leaf.dtype.itemsize]).ravel()
    bits, position = words.astype(np.uint64), np.arange(words.size, dtype=np.uint64)
    sums = [((position * 2654435761 + 1) % 2**32 * bits).sum() % 2**32,
            ((position + index) % 2**32 * bits).sum() % 2**32]
    total = (total * 31 + np.array(sums, np.uint64)) % 2**32
  return total.tolist()


def test_the_checksum_of_a_weight_larger_than_a_block_is_the_one_runs_already_saved():
  # Pointers written by earlier versions hold checksums: the blocked sums must equal them.
  rng = np.random.default_rng(0)
  leaves = [jnp.asarray(rng.standard_normal(2 * base_run.CHECKSUM_BLOCK + 5), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((3, 7)), jnp.float32),
            jnp.asarray(rng.integers(-9, 9, base_run.CHECKSUM_BLOCK), jnp.int8)]
  assert base_run.checksum(leaves).tolist() == _numpy_checksum(leaves)


def test_a_cast_to_the_checksum_s_dtype_and_back_keeps_other_leaves_and_the_bits():
  weights = {"w": jnp.array([1.0, 2.5, -3.0], jnp.float32), "steps": jnp.arange(3)}
  narrow = base_run.with_dtype(weights, "float32", "bfloat16")
  assert narrow["w"].dtype == jnp.bfloat16 and narrow["steps"].dtype == weights["steps"].dtype
  back = base_run.with_dtype(narrow, "bfloat16", "float32")
  assert back["w"].dtype == jnp.float32 and (back["w"] == weights["w"]).all()
  shapes = base_run.with_dtype(jax.eval_shape(lambda: weights), "float32", "bfloat16")
  assert shapes["w"].dtype == jnp.bfloat16 and shapes["steps"].dtype == weights["steps"].dtype
  assert base_run.with_dtype(weights, "float32", "float32") is weights


def test_the_checksum_s_dtype_is_the_pointer_s_or_the_saved_config_s():
  saved = {"config": {"model": {"param_dtype": "bfloat16"}}}
  assert base_run.start_dtype({"dtype": "float32"}, saved) == "float32"
  assert base_run.start_dtype({}, saved) == "bfloat16"  # A pointer written before `dtype`.
  assert base_run.start_dtype({}, None) == ""
