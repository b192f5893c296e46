"""Data mixtures: each row's corpus as a pure function of (seed, row), stages by step."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jax_ai_stack import cli
from jax_ai_stack.errors import ConfigError, DataError
from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes import train
from jax_ai_stack.recipes.data import build_dataset, validation_sets
from jax_ai_stack.recipes.data.mixture import MixtureRows, block_counts
from training_helpers import TINY


@pytest.mark.parametrize("weights,rows", [([0.7, 0.3], 8), ([1, 1, 1], 1024), ([0, 5, 1e-9], 7),
                                          ([0.123, 0.456, 0.421], 1000)])
def test_block_counts_sum_to_the_block_and_round_the_shares(weights, rows):
  counts = block_counts(weights, rows)
  exact = rows * np.asarray(weights) / sum(weights)
  assert counts.sum() == rows
  assert np.all(np.abs(counts - exact) < 1)


STAGES = [(0, [0.5, 0.3, 0.2]), (1000, [0, 1, 1]), (2500, [0.1, 0.1, 0.8])]


def test_each_component_reads_its_stream_in_order_once():
  rows = MixtureRows(["a", "b", "c"], STAGES, seed=3, block_rows=64)
  component, position = rows.assign(np.arange(5000))
  for c in range(3):
    assert position[component == c].tolist() == list(range((component == c).sum()))
  for row in (0, 1, 63, 64, 999, 1000, 1001, 2500, 4999):
    assert rows.rows_before(row).tolist() == np.bincount(component[:row], minlength=3).tolist()


def test_any_row_alone_gives_what_it_gives_in_the_stream():
  rows = MixtureRows(["a", "b", "c"], STAGES, seed=3, block_rows=64)
  component, position = rows.assign(np.arange(5000))
  some = np.random.default_rng(0).permutation(5000)[:97]
  alone = MixtureRows(["a", "b", "c"], STAGES, seed=3, block_rows=64).assign(some)
  assert alone[0].tolist() == component[some].tolist()
  assert alone[1].tolist() == position[some].tolist()


def test_every_block_holds_the_stage_weights_exactly_and_the_seed_deals_it():
  rows = MixtureRows(["a", "b", "c"], STAGES, seed=3, block_rows=64)
  component, _ = rows.assign(np.arange(5000))
  assert np.bincount(component[:64], minlength=3).tolist() == block_counts([0.5, 0.3, 0.2], 64).tolist()
  assert 0 not in component[1000:2500]  # Stage 2 gives "a" nothing.
  assert np.bincount(component[2500:2564], minlength=3).tolist() == block_counts(
      [0.1, 0.1, 0.8], 64).tolist()
  other = MixtureRows(["a", "b", "c"], STAGES, seed=4, block_rows=64).assign(np.arange(64))[0]
  assert other.tolist() != component[:64].tolist()


def test_stages_must_start_at_zero_and_go_forward():
  with pytest.raises(ValueError, match="start at row 0 and increase"):
    MixtureRows(["a"], [(0, [1]), (0, [1])], seed=0)


@pytest.fixture
def corpora(tmp_path):
  """Two corpora told apart by their bytes: every row of a batch names its source."""
  for name, letter in (("ay", "a"), ("bee", "b")):
    folder = tmp_path / name
    folder.mkdir()
    for i in range(6):
      (folder / f"{i}.txt").write_text("".join(f"{letter * 40} {i} {j}\n" for j in range(30)))
  return tmp_path


def _overrides(corpora, stages="[{step: 0, weights: {ay: 3, bee: 1}}, {step: 5, weights: {bee: 1}}]",
               cached=False):
  def component(name):
    cache = f", cache: '{corpora}/{name}-cache'" if cached else ""
    return f"{name}: {{source: text, paths: ['{corpora}/{name}/*.txt']{cache}}}"

  return [*TINY, "data.max_documents=null", "data.batch_size=8",
          f"data.mixture={{components: {{{component('ay')}, {component('bee')}}}, "
          f"stages: {stages}}}"]


def _mixture(corpora, stages="[{step: 0, weights: {ay: 3, bee: 1}}, {step: 5, weights: {bee: 1}}]",
             *extra):
  return config_lib.load("lm-tiny", overrides=[*_overrides(corpora, stages), *extra])


def _sources(batch) -> list[str]:
  """The letter each row was read from (byte tokens are the bytes)."""
  return ["a" if (row == ord("a")).sum() > (row == ord("b")).sum() else "b"
          for row in batch["inputs"]]


def test_a_mixture_feeds_each_row_from_its_component_and_switches_at_the_stage_step(corpora):
  data = _mixture(corpora, "[{step: 0, weights: {ay: 3, bee: 1}}, {step: 130, weights: {bee: 1}}]"
                  ).data
  ds = build_dataset(data, split="train", seed=0, process_index=0, process_count=1)
  with contextlib.closing(iter(ds)) as iterator:
    rows = [row for _ in range(135) for row in _sources(next(iterator))]
  dealt = MixtureRows(["ay", "bee"], [(0, [3, 1]), (130 * 8, [0, 1])], seed=0).assign(
      np.arange(135 * 8))[0]
  assert rows == ["ab"[c] for c in dealt]  # Row by row, as the arithmetic says.
  assert rows[:1024].count("a") == 768  # 3:1, exactly, over each block of 1024 rows.
  assert set(rows[130 * 8:]) == {"b"}  # The second stage from its step on.


def test_processes_read_their_own_rows_of_the_same_global_batch(corpora):
  data = _mixture(corpora).data
  whole = build_dataset(data, split="train", seed=0, process_index=0, process_count=1)
  halves = [build_dataset(data, split="train", seed=0, process_index=p, process_count=2)
            for p in (0, 1)]
  with contextlib.closing(iter(whole)) as w, contextlib.closing(iter(halves[0])) as h0, \
      contextlib.closing(iter(halves[1])) as h1:
    for _ in range(6):
      batch, first, second = next(w), next(h0), next(h1)
      np.testing.assert_array_equal(batch["inputs"],
                                    np.concatenate([first["inputs"], second["inputs"]]))


def test_a_restored_iterator_goes_on_with_the_same_batch(corpora):
  data = _mixture(corpora).data
  ds = build_dataset(data, split="train", seed=0, process_index=0, process_count=1)
  with contextlib.closing(iter(ds)) as iterator:
    for _ in range(4):
      next(iterator)
    state, expected = iterator.get_state(), next(iterator)
  with contextlib.closing(iter(ds)) as iterator:
    iterator.set_state(state)
    np.testing.assert_array_equal(next(iterator)["inputs"], expected["inputs"])


def test_each_component_has_its_own_validation_split(corpora):
  sets = validation_sets(_mixture(corpora).data, seed=0, process_index=0, process_count=1)
  assert list(sets) == ["ay", "bee"]
  with contextlib.closing(iter(sets["bee"])) as iterator:
    assert set(_sources(next(iterator))) == {"b"}


@pytest.mark.parametrize("stages,error", [
    ("[{step: 0, weights: {ay: 0}}]", r"stages\[0\]\.weights=\{'ay': 0\.0\}: weights must be >= 0 "
                                      "and sum to a positive number"),
    ("[{step: 0, weights: {ay: 1}}, {step: 4, weights: {ay: 1}}, {step: 2, weights: {ay: 1}}]",
     r"stages\[2\]\.step=2 goes back in time: it must come after the stage before \(step 4\)"),
    ("[{step: 1, weights: {ay: 1}}]", r"stages\[0\]\.step=1: the first stage starts at step 0"),
    ("[{step: 0, weights: {ay: 1, sea: 1}}]", r"stages\[0\]\.weights: sea is no component"),
    ("[{step: 0, weights: {ay: -1, bee: 2}}]", r"weights must be >= 0"),
])
def test_bad_stages_are_refused_by_field(corpora, stages, error):
  with pytest.raises(ConfigError, match=error):
    _mixture(corpora, stages)


def test_components_read_their_own_token_caches_bitwise(corpora, capsys):
  cached = _overrides(corpora, cached=True)
  assert cli.main(["data", "prepare", "--quiet", *cached]) == 0
  out = capsys.readouterr().out
  assert f"{corpora}/ay-cache: 6 documents" in out and "(component bee)" in out
  assert cli.main(["data", "prepare", "--cache", "x", *cached]) == 2
  assert "a mixture's components name their own caches" in capsys.readouterr().err

  def batches(overrides):
    data = config_lib.load("lm-tiny", overrides=overrides).data
    ds = build_dataset(data, split="train", seed=0, process_index=0, process_count=1)
    with contextlib.closing(iter(ds)) as iterator:
      return [next(iterator)["inputs"] for _ in range(8)]

  for a, b in zip(batches(cached), batches(_overrides(corpora))):
    np.testing.assert_array_equal(a, b)


def test_a_component_with_no_data_is_named(corpora):
  (corpora / "bee" / "empty").mkdir()
  (corpora / "bee" / "empty" / "0.txt").write_text("")
  components = (f"{{ay: {{source: text, paths: ['{corpora}/ay/*.txt']}}, "
                f"bee: {{source: text, paths: ['{corpora}/bee/empty/*.txt']}}}}")
  data = config_lib.load("lm-tiny", overrides=[
      *TINY, f"data.mixture={{components: {components}, stages: [{{step: 0, weights: {{ay: 1}}}}]}}"
  ]).data
  with pytest.raises(DataError, match=r"^data\.mixture\.components\.bee: "):
    build_dataset(data, split="train", seed=0, process_index=0, process_count=1)


def test_a_mixture_replaces_the_single_source(corpora):
  with pytest.raises(ConfigError, match="leave data.source, data.paths and data.cache unset"):
    _mixture(corpora, "[{step: 0, weights: {ay: 1}}]", "data.source=text", "data.paths=[x.txt]")


@pytest.mark.slow
def test_a_mixed_run_evaluates_each_component_and_logs_its_tokens(corpora, tmp_path):
  """(A mixed run killed and resumed: test_kill_and_resume.py.)"""
  cfg = _mixture(corpora, "[{step: 0, weights: {ay: 3, bee: 1}}, {step: 6, weights: {bee: 1}}]",
                 "train.steps=10", "train.eval_every=5", "checkpoint.save_every=3")
  straight = train.run(cfg, tmp_path / "straight")
  assert {"eval_loss", "eval_ay_loss", "eval_bee_loss"} <= set(straight)
  assert straight["eval_loss"] == pytest.approx((straight["eval_ay_loss"]
                                                 + straight["eval_bee_loss"]) / 2)
  last = [r for r in train.read_metrics(tmp_path / "straight") if r["split"] == "train"][-1]
  seen = MixtureRows(["ay", "bee"], [(0, [3, 1]), (6 * 8, [0, 1])], seed=0).rows_before(10 * 8)
  assert [last["tokens_ay"], last["tokens_bee"]] == (seen * 16).tolist()  # Logged per step.
