"""benchmarks/attention.py runs end to end at a tiny shape and writes its JSON."""

from __future__ import annotations

import json
import pathlib
import runpy
import sys

import pytest

BENCHMARK = pathlib.Path(__file__).parents[1] / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def benchmark_main():
  if str(BENCHMARK.parent) not in sys.path:  # As `python benchmarks/attention.py` puts it,
    sys.path.append(str(BENCHMARK.parent))  # for its `import common`.
  return runpy.run_path(str(BENCHMARK), run_name="attention_benchmark")["main"]


@pytest.mark.filterwarnings("ignore:jax.core.is_concrete is deprecated:DeprecationWarning")
def test_benchmark_times_every_eligible_kernel_against_the_reference(benchmark_main, tmp_path, capsys):
  output = tmp_path / "attention.json"
  results = benchmark_main(["--shape", "1,32,2,1,8", "--segment-ids", "--iterations", "1",
                            "--rounds", "1", "--out", str(output)])
  assert json.loads(output.read_text()) == json.loads(json.dumps(results))
  # xla_blocked too: "auto" passes it over at T 32, but its rule is measured here.
  assert set(results["times_ms"]) == {
      "reference", "auto", "tokamax_xla", "xla", "tokamax_xla_chunked", "xla_blocked"}
  assert results["chosen"] == "tokamax_xla"
  assert results["torch_sdpa"] in ("torch SDPA is compared only with causal or no mask",
                                   "torch is not installed")
  for name, ms in results["times_ms"].items():
    assert ms > 0
    assert results["ratio_to_reference"][name] == pytest.approx(ms / results["times_ms"]["reference"])
  fastest = min(("tokamax_xla", "xla", "tokamax_xla_chunked", "xla_blocked"),
                key=results["times_ms"].get)
  assert results["fastest_eligible"] == fastest
  table = capsys.readouterr().out
  assert "* tokamax_xla" in table and "vs reference" in table


def test_benchmark_rejects_a_bad_shape(benchmark_main, capsys):
  with pytest.raises(SystemExit) as e:
    benchmark_main(["--shape", "1,32,2"])
  assert e.value.code == 2 and "--shape '1,32,2' must be five positive ints" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:jax.core.is_concrete is deprecated:DeprecationWarning")
def test_benchmark_times_block_sizes_and_auto_picks_the_blocked_kernel_at_t256(
    benchmark_main, tmp_path, capsys):
  results = benchmark_main(["--shape", "1,256,2,1,8", "--block-sizes", "64,256", "--no-torch",
                            "--iterations", "1", "--rounds", "1",
                            "--out", str(tmp_path / "a.json")])
  assert results["chosen"] == "xla_blocked"
  assert {"xla_blocked@64", "xla_blocked@256", "xla_blocked"} <= set(results["times_ms"])
  assert all(ms > 0 for ms in results["times_ms"].values())
  assert results["torch_sdpa"] == "--no-torch" and results["auto_over_torch_sdpa"] is None
  assert "torch SDPA not timed: --no-torch" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:jax.core.is_concrete is deprecated:DeprecationWarning")
def test_benchmark_times_torch_sdpa_in_the_same_rounds(benchmark_main, tmp_path, capsys):
  pytest.importorskip("torch")
  results = benchmark_main(["--shape", "1,256,2,1,8", "--iterations", "1", "--rounds", "2",
                            "--out", str(tmp_path / "a.json")])
  assert results["torch_sdpa"] == "timed" and results["times_ms"]["torch_sdpa"] > 0
  assert results["auto_over_torch_sdpa"] == pytest.approx(
      min(results["times_ms"]["auto"], results["times_ms"]["xla_blocked"])
      / results["times_ms"]["torch_sdpa"])
  assert "auto / torch SDPA (is_causal=True, torch on cpu" in capsys.readouterr().out


def test_benchmark_rejects_bad_block_sizes(benchmark_main, capsys):
  with pytest.raises(SystemExit) as e:
    benchmark_main(["--shape", "1,32,2,1,8", "--block-sizes", "64,0"])
  assert e.value.code == 2 and "--block-sizes '64,0' must be positive ints" in capsys.readouterr().err
