"""benchmarks/aot_table.py: the plan against XLA per recipe and topology, and its table.

The compiles need libtpu at this row's pin (.ci/run's topology row installs it and sets
JAX_AI_STACK_TEST_TOPOLOGIES=1, which turns the skip into a failure); the table's
formatting and the row selection need nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None
    and os.environ.get("JAX_AI_STACK_TEST_TOPOLOGIES") != "1",  # CI's row: run, and fail.
    reason="libtpu is not installed")


@pytest.fixture(scope="module")
def aot_table():
  if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))  # Its `import common`, as `python benchmarks/...` has.
  spec = importlib.util.spec_from_file_location("_benchmark_aot_table",
                                                BENCHMARKS / "aot_table.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


def record(**overrides):
  values = dict(row="lm-tiny@v5e:2x2", recipe="lm-tiny", topology="v5e:2x2", plan=25 * 2**20,
                xla=26 * 2**20, ratio=1.04, fits=True, hbm=16 * 2**30,
                compile_seconds={"train step": 6.0, "eval step": 2.5}, mfu_ceiling=0.123)
  return {**values, **overrides}


def test_the_table_has_a_line_per_row_and_marks_what_is_off(aot_table):
  table = aot_table.markdown([
      record(),
      record(recipe="llama3-8b", topology="v5e:4x4", plan=20 * 2**30, xla=26 * 2**30,
             ratio=1.3, fits=False, mfu_ceiling=None),
      {"recipe": "gemma3-12b", "topology": "v5p:2x2x2", "error": "UsageError: too big"}])
  lines = table.splitlines()
  assert lines[0].startswith("| recipe | topology | plan / device | XLA / device | XLA / plan |")
  assert lines[2] == "| lm-tiny | v5e:2x2 | 25.0 MiB | 26.0 MiB | 1.04 | yes | 8.5 | 12% |"
  assert lines[3] == ("| llama3-8b | v5e:4x4 | 20.00 GiB | 26.00 GiB | 1.30 * | no (16.00 GiB) "
                      "| 8.5 |  |")
  assert lines[4] == "| gemma3-12b | v5p:2x2x2 | | | | | | UsageError: too big |"
  assert len(lines) == 5


def test_a_row_out_of_tolerance_is_a_failure_unless_explained(aot_table, monkeypatch):
  off = record(row="lm-tiny-grpo@v5p:2x2x1", recipe="lm-tiny-grpo", topology="v5p:2x2x1",
               ratio=0.56)
  assert aot_table.unexplained([record(), off, {"row": "x@v5e:2x2", "error": "E"}]) == [
      "lm-tiny-grpo@v5p:2x2x1"]
  assert "| 0.56 * |" in aot_table.markdown([off])
  monkeypatch.setitem(aot_table.EXPLAINED, "lm-tiny-grpo@v5p:2x2x1", "the engine")
  assert aot_table.unexplained([record(), off]) == []
  table = aot_table.markdown([off])
  assert "| 0.56 † |" in table and table.endswith("\n† lm-tiny-grpo on v5p:2x2x1: the engine.\n")
  assert aot_table.markdown([record(ratio=1.1)]).count("†") == 0  # Within: no reason shown.


def test_every_explained_row_is_a_row(aot_table):
  assert set(aot_table.EXPLAINED) <= {r.id for r in aot_table.rows()}


def test_the_table_prints_again_from_measured_rows(aot_table, tmp_path, capsys):
  measured = tmp_path / "rows.json"
  measured.write_text(json.dumps({"rows": [record(), record(row="b", ratio=1.3)]}))
  assert aot_table.main(["--markdown", str(measured)])["unexplained"] == ["b"]
  assert "| lm-tiny | v5e:2x2 | 25.0 MiB | 26.0 MiB | 1.04 |" in capsys.readouterr().out


def test_rows_are_every_preset_on_every_slice_then_the_real_sizes(aot_table):
  small = aot_table.select(["small"])
  assert len(small) == len(aot_table.SMALL) * len(aot_table.SLICES)
  assert {r.id for r in aot_table.select(["large"])} >= {
      "llama3-8b@v5p:2x2x1", "llama3-8b-unrolled@v5p:2x2x1", "llama3-8b@v5e:4x4",
      "qwen3-30b-a3b@v5p:2x2x2", "gemma3-12b@v5p:2x2x2", "qwen3-8b-grpo@v6e:2x4"}
  assert [r.id for r in aot_table.select(["moe-tiny@v5e:2x2"])] == ["moe-tiny@v5e:2x2"]
  assert aot_table.select(["moe-tiny@v5e:2x2"])[0].overrides == ("mesh.expert=2",)
  with pytest.raises(SystemExit, match="no row 'lm-tiny@v9:2'"):
    aot_table.select(["lm-tiny@v9:2"])


def test_the_real_sizes_configs_load(aot_table):
  """Every large row's overrides make a valid config (a typo would cost a long compile)."""
  from jax_ai_stack.recipes import config

  for row in aot_table.select(["large"]):
    loaded = config.load(row.recipe, overrides=list(row.overrides))
    assert loaded.model.dtype == "bfloat16", row.id


@needs_libtpu
@pytest.mark.slow
def test_lm_tiny_on_a_v5e_slice_is_within_the_tolerance(aot_table, tmp_path):
  out = tmp_path / "aot_table.json"
  results = aot_table.main(["--rows", "lm-tiny@v5e:2x2", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(results))
  (row,) = results["rows"]
  assert "error" not in row, row
  assert row["fits"] and row["largest"] == "train step"
  assert abs(row["ratio"] - 1) <= aot_table.TOLERANCE, row
  assert results["unexplained"] == []
  assert "| lm-tiny | v5e:2x2 |" in out.with_suffix(".md").read_text()
