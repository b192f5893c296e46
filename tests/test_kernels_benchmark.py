"""benchmarks/attention.py runs end to end at a tiny shape and writes its JSON."""

from __future__ import annotations

import json
import pathlib
import runpy

import pytest

BENCHMARK = pathlib.Path(__file__).parents[1] / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def benchmark_main():
  return runpy.run_path(str(BENCHMARK), run_name="attention_benchmark")["main"]


@pytest.mark.filterwarnings("ignore:jax.core.is_concrete is deprecated:DeprecationWarning")
def test_benchmark_times_every_eligible_kernel_against_the_reference(benchmark_main, tmp_path, capsys):
  output = tmp_path / "attention.json"
  results = benchmark_main(["--shape", "1,32,2,1,8", "--segment-ids", "--iterations", "1",
                            "--rounds", "1", "--output", str(output)])
  assert json.loads(output.read_text()) == json.loads(json.dumps(results))
  assert set(results["times_ms"]) == {"reference", "auto", "tokamax_xla", "xla", "tokamax_xla_chunked"}
  assert results["chosen"] == "tokamax_xla"
  for name, ms in results["times_ms"].items():
    assert ms > 0
    assert results["ratio_to_reference"][name] == pytest.approx(ms / results["times_ms"]["reference"])
  fastest = min(("tokamax_xla", "xla", "tokamax_xla_chunked"), key=results["times_ms"].get)
  assert results["fastest_eligible"] == fastest
  table = capsys.readouterr().out
  assert "* tokamax_xla" in table and "vs reference" in table


def test_benchmark_rejects_a_bad_shape(benchmark_main, capsys):
  with pytest.raises(SystemExit) as e:
    benchmark_main(["--shape", "1,32,2"])
  assert e.value.code == 2 and "--shape '1,32,2' must be five positive ints" in capsys.readouterr().err
