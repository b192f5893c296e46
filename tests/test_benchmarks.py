"""Smoke tests of benchmarks/: each main() runs at a tiny size and writes its JSON.

The speed targets themselves live in the benchmarks, not here: these tests
check that the benchmarks run, measure something, and report it in the shape
that readers of benchmarks/results/*.json expect.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
  """Imports benchmarks/<name>.py (a script folder, not a package).

  The folder goes on sys.path, as `python benchmarks/<name>.py` puts it, for
  the scripts' own imports (common, torch_process).
  """
  if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))
  module_name = f"_benchmark_{name}"
  if module_name not in sys.modules:
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
  return sys.modules[module_name]


@pytest.fixture(scope="module")
def train_step():
  return _load("train_step")


@pytest.fixture(scope="module")
def checkpoint():
  return _load("checkpoint")


def _run_quick(name: str, tmp_path: pathlib.Path, *argv: str) -> dict:
  """Runs benchmarks/<name>.py --quick; checks it wrote what it returned, with the header."""
  out = tmp_path / "results" / f"{name}.json"
  returned = _load(name).main(["--quick", *argv, "--out", str(out)])
  results = json.loads(out.read_text())
  assert results == json.loads(json.dumps(returned))
  assert results["benchmark"] == name and results["python"].count(".") == 2
  return results


def test_train_step_quick_writes_positive_figures(train_step, tmp_path):
  results = _run_quick("train_step", tmp_path)
  assert results["device"].startswith("cpu") and results["jax"]
  assert results["matmul_peak_tflops"] > 0
  size = results["sizes"]["quick"]
  expected = {"recipe", "hand_written", "nnx_jit"}
  if train_step.has_tree_mode_jit():
    expected.add("nnx_jit_tree")
  assert set(size["variants"]) == expected
  for name, timing in size["variants"].items():
    for key in ("ms_per_step", "ms_per_step_min", "tokens_per_s", "mfu"):
      assert timing[key] > 0, (name, key, timing[key])
  assert size["flops_per_step"] > 0 and size["tokens_per_step"] == 2 * 16
  assert size["ratio_recipe_vs_hand_written"] > 0 and size["ratio_recipe_vs_hand_written_min"] > 0
  assert isinstance(size["met_target"], bool)
  # Same init, same batch, same optimizer: every way of jitting gives the same bits.
  assert size["bitwise_identical"], size["equality_vs_recipe"]


def test_train_step_compare_params_reports_a_difference(train_step):
  reference = train_step.Variant("recipe", None, lambda: {"w": np.zeros(3, np.float32)})
  same = train_step.Variant("same", None, lambda: {"w": np.zeros(3, np.float32)})
  off = train_step.Variant("off", None, lambda: {"w": np.array([0, 0, 2**-20], np.float32)})
  result = train_step.compare_params([reference, same, off])
  assert result["same"] == {"bitwise_identical": True, "max_abs_diff": 0.0}
  assert result["off"] == {"bitwise_identical": False, "max_abs_diff": 2**-20}


@pytest.mark.parametrize("script, argv, message", [
    ("train_step", ["--sizes", "tiny,huge"], "unknown size huge; choose from tiny, medium, quick"),
    ("train_step", ["--repeats", "0"], "must be an integer >= 1, got '0'"),
    ("train_step", ["--min-chunk-seconds", "-1"], "must be a number >= 0, got '-1'"),
    ("train_step", ["--min-chunk-seconds", "nan"], "must be a number >= 0, got 'nan'"),
    ("train_step", ["--torch-threads", "0"], "must be an integer >= 1, got '0'"),
    ("startup", ["--rounds", "none"], "must be an integer >= 1, got 'none'"),
    ("checkpoint", ["--size-mb", "0"], "must be a number > 0, got '0'"),
    ("checkpoint", ["--rounds", "two"], "must be a number > 0, got 'two'"),
    ("checkpoint", ["--dir", "/no/such/dir"], "'/no/such/dir' is not an existing directory"),
])
def test_scripts_reject_bad_arguments(capsys, script, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    _load(script).parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_checkpoint_quick_writes_positive_figures_and_cleans_up(tmp_path):
  workdir = tmp_path / "disk"
  workdir.mkdir()
  results = _run_quick("checkpoint", tmp_path, "--dir", str(workdir))
  for key in ("sync_save_s", "async_blocking_s", "async_total_s", "raw_write_s",
              "sync_save_mb_per_s", "raw_write_mb_per_s", "save_vs_raw_throughput",
              "async_blocking_ratio", "bytes_on_disk"):
    assert results[key] > 0, (key, results[key])
  assert results["state_bytes"] == 4 * 2**20
  assert results["async_total_s"] >= results["async_blocking_s"]
  assert isinstance(results["met_target"], bool)
  assert results["directory"] == str(workdir)
  assert list(workdir.iterdir()) == []  # Checkpoints and the raw file are gone.


def test_checkpoint_raw_write_writes_every_byte(checkpoint, tmp_path, monkeypatch):
  written = []
  real_write = checkpoint.os.write
  monkeypatch.setattr(checkpoint.os, "write", lambda fd, b: written.append(len(b)) or real_write(fd, b))
  data = np.arange(1000, dtype=np.float32)
  seconds = checkpoint.raw_write_seconds(tmp_path, [memoryview(data).cast("B")])
  assert seconds > 0 and sum(written) == data.nbytes
  assert list(tmp_path.iterdir()) == []


def test_checkpoint_refuses_a_disk_without_room(checkpoint, tmp_path, monkeypatch, capsys):
  usage = checkpoint.shutil.disk_usage(tmp_path)
  monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: usage._replace(free=2**20))
  with pytest.raises(SystemExit, match=r"has 1 MiB free; --size-mb 4 needs about 12 MiB"):
    checkpoint.main(["--quick", "--dir", str(tmp_path), "--out", str(tmp_path / "x.json")])
  assert list(tmp_path.iterdir()) == []  # Nothing written, the temporary directory removed.


@pytest.mark.slow
def test_token_cache_quick_writes_positive_figures(tmp_path):
  workdir = tmp_path / "disk"
  workdir.mkdir()
  results = _run_quick("token_cache", tmp_path, "--dir", str(workdir))
  assert {(row["tokenizer"], row["workers"]) for row in results["prepare"]} >= {
      ("byte", 1), ("byte", 2)}
  for row in results["prepare"]:
    assert row["tokens_per_s"] > 0 and row["raw_tokens_per_s"] > 0 and row["vs_raw"] > 0, row
  for key in ("windows_tokens_per_s", "sequential_tokens_per_s", "raw_file_tokens_per_s"):
    assert results["read"][key] > 0, key
  memory = results["memory"]
  assert memory["big"]["num_tokens"] > memory["small"]["num_tokens"]
  assert memory["small"]["peak_rss_mb"] > 0 and isinstance(memory["met_target"], bool)
  assert list(workdir.iterdir()) == []  # the work is removed


@pytest.mark.slow
def test_startup_quick_finds_the_warm_run_in_the_cache(tmp_path):
  results = _run_quick("startup", tmp_path)
  (round_,) = results["rounds"]
  assert round_["cache_entries"] >= 2 and round_["cache_bytes"] > 0
  assert round_["warm"]["cache_hits"] >= 2  # At least the initialisation and the train step.
  for kind in ("cold", "warm"):
    assert round_[kind]["first_step_s"] >= round_[kind]["import_s"] > 0
  assert results["ratio_warm_vs_cold"] > 0 and isinstance(results["met_target"], bool)


@pytest.mark.slow
def test_real_size_quick_runs_the_journey_and_holds_each_training_peak_to_its_plan(tmp_path):
  results = _run_quick("real_size", tmp_path)
  steps = results["steps"]
  assert list(steps) == ["write", "import", "lora", "full", "generate", "serve", "export"]
  assert steps["write"]["files"] > 3  # Shards, their index and config.json.
  for name in ("import", "lora", "full", "generate", "serve", "export"):
    assert steps[name]["seconds"] > 0 and steps[name]["peak_bytes"] > 100 << 20, name
  for kind in ("lora", "full"):
    figures = steps[kind]
    assert figures["s_per_step"] > 0 and figures["tokens_per_s"] > 0
    assert figures["peak_over_plan"] == figures["peak_bytes"] / figures["plan_bytes"]
  assert steps["lora"]["plan_bytes"] < steps["full"]["plan_bytes"]  # Adam moments of adapters.
  assert steps["serve"]["completion_tokens"] > 0 and steps["generate"]["tokens_per_s"] > 0
  assert results["met_target"] == all(steps[k]["target"]["met"] for k in ("lora", "full"))


@pytest.mark.slow
def test_compile_depth_quick_times_both_layouts_at_each_depth(tmp_path):
  results = _run_quick("compile_depth", tmp_path)
  assert [row["num_layers"] for row in results["rows"]] == list(_load("compile_depth").QUICK_DEPTHS)
  for row in results["rows"]:
    for layout in ("unrolled", "scanned"):
      assert row[layout]["total_s"] >= row[layout]["compile_s"] > 0
    assert row["ratio"] == row["scanned"]["total_s"] / row["unrolled"]["total_s"]
  assert results["met_target"] is None  # --quick does not judge the target.


@pytest.mark.slow
def test_data_quick_writes_its_record_with_the_header(tmp_path):
  results = _run_quick("data", tmp_path)
  assert results["device"].startswith("cpu")
  assert results["numpy_batches_per_s"] > 0 and len(results["pipeline"]) == 4
  assert all(row["batches_per_s"] > 0 for row in results["pipeline"])
  assert isinstance(results["target_wait_fraction_below_2_percent"], bool)


def test_startup_rejects_output_without_a_start_up_line():
  startup = _load("startup")
  with pytest.raises(ValueError, match="no start-up line"):
    startup.parse_startup("recipe lm-tiny: preparing data and model ...\n")
  line = ("start-up: import 1.5 s, init 2.0 s (data, model, checkpoint), first step after 3.5 s; "
          "of which trace 1.0 s, compile 0.5 s (2 programs, 2 loaded from the cache /c)")
  assert startup.parse_startup(line)["first_step_s"] == 5.0
  assert startup.parse_startup(line)["cache_hits"] == 2


def test_quant_quick_reports_every_scheme_smaller_than_float(tmp_path):
  results = _run_quick("quant", tmp_path)
  variants = results["variants"]
  assert list(variants) == ["float", "w8", "w8a8", "w4"]
  assert variants["float"]["loss_delta"] == 0 and variants["float"]["bytes_vs_float"] == 1
  for name in ("w8", "w8a8", "w4"):
    assert variants[name]["ms_per_forward"] > 0 and abs(variants[name]["loss_delta"]) < 0.05
    assert variants[name]["param_bytes"] < variants["float"]["param_bytes"]
  assert variants["w4"]["param_bytes"] < variants["w8"]["param_bytes"]


def test_moe_quick_times_each_grouped_matmul_against_the_dense_mlp(tmp_path):
  results = _run_quick("moe", tmp_path)
  variants = results["variants"]
  assert list(variants) == ["dense", "moe-tokamax", "moe-xla", "moe-blocked", "moe-dense"]
  assert variants["dense"]["vs_dense"] == 1 and all(v["ms_per_pass"] > 0 for v in variants.values())
  assert results["best_grouped_matmul"] in ("moe-tokamax", "moe-xla", "moe-blocked")
  assert results["best_vs_dense"]["value"] == variants[results["best_grouped_matmul"]]["vs_dense"]


@pytest.mark.slow
def test_lora_quick_reports_fewer_trainable_parameters_than_full(tmp_path):
  results = _run_quick("lora", tmp_path)
  size = results["sizes"]["quick"]
  variants = size["variants"]
  assert list(variants) == ["full", "lora", "qlora"]
  assert variants["full"]["trainable_params"] == size["model_params"]
  for name in ("lora", "qlora"):
    assert 0 < variants[name]["trainable_params"] < variants["full"]["trainable_params"]
    assert variants[name]["optimizer_state_bytes"] < variants["full"]["optimizer_state_bytes"]
    assert variants[name]["ms_per_step"] > 0 and variants[name]["ratio_vs_full"] > 0
  # B starts at zero: step 0 of LoRA is the base model itself.
  assert variants["lora"]["first_loss"] == pytest.approx(variants["full"]["first_loss"], abs=1e-6)


def test_train_step_torch_needs_torch(train_step, capsys, monkeypatch):
  monkeypatch.setattr(train_step, "has_torch", lambda: False)
  with pytest.raises(SystemExit) as exit_info:
    train_step.parse_args(["--torch"])
  assert exit_info.value.code == 2
  assert "--torch needs PyTorch" in capsys.readouterr().err


def test_train_step_does_not_compare_bits_of_other_numerics(train_step):
  reference = train_step.Variant("recipe", None, lambda: {"w": np.zeros(3, np.float32)})
  bf16 = train_step.Variant("recipe_bf16", None, None)
  assert train_step.compare_params([reference, bf16]) == {}


def test_torch_llama_computes_the_recipe_s_loss(train_step):
  pytest.importorskip("torch")
  torch_llama = _load("torch_llama")
  size = train_step.SIZES["quick"]
  for config in (size.model, size.model.tiny(**{**_fields(size.model), "tie_embeddings": False})):
    model = train_step._init_fn(config)()
    batch = train_step.make_batch(train_step.dataclasses.replace(size, model=config))
    params = train_step._flat(train_step.nnx.state(model, train_step.nnx.Param))
    jax_loss = float(train_step.lm_loss(model, batch)[0])
    assert torch_llama.first_loss(config, params, batch) == pytest.approx(jax_loss, abs=1e-5)


def _fields(config) -> dict:
  return {f: getattr(config, f) for f in ("num_layers", "d_model", "num_heads", "num_kv_heads",
                                          "mlp_dim", "max_seq_len")}


@pytest.mark.slow  # torch.compile of two models and four parts: ~25 s on 2 cores.
@pytest.mark.cpu_backend
def test_train_step_quick_torch_writes_the_comparison(train_step, tmp_path):
  pytest.importorskip("torch")
  results = train_step.main(["--quick", "--torch", "--out", str(tmp_path / "t.json")])
  size = results["sizes"]["quick"]
  assert set(train_step.TORCH_VARIANTS) | {"recipe_bf16"} <= set(size["variants"])
  assert size["first_loss"]["abs_diff"] < 1e-5, size["first_loss"]
  assert results["torch"] == size["torch_process"]["torch"] and size["torch_process"]["threads"] >= 1
  assert size["bitwise_identical"]  # recipe_bf16 and torch are left out of the comparison.
  for key in ("ratio_recipe_vs_torch_compile", "ratio_recipe_vs_torch_eager", "ratio_bf16_vs_f32"):
    assert size[key] > 0, key
  parts = {"attention core", "projections", "MLP", "head + loss", "optimizer", "everything else"}
  assert set(size["components_add_up"]) == {"recipe", "torch_compile"}
  for framework in ("recipe", "torch_compile"):
    row = size["components_ms"][framework]
    assert parts | {"step"} == set(row)
    assert all(row[p] > 0 for p in parts - {"everything else"}), row
  judged = size["torch_targets"]["recipe / torch.compile"]
  assert judged["value"] == size["ratio_recipe_vs_torch_compile"] and judged["target"] == 1.0
  share = size["torch_targets"]["everything else / recipe step"]["value"]
  assert share == size["components_ms"]["recipe"]["everything else"] / size["variants"]["recipe"][
      "ms_per_step"]


def test_a_parts_column_that_does_not_add_up_to_its_step_says_so(train_step, capsys):
  fine = {"attention core": 40.0, "projections": 30.0, "MLP": 20.0, "head + loss": 5.0,
          "optimizer": 5.0, "everything else": 8.0, "step": 108.0}
  wild = {**fine, "attention core": 248.0, "projections": 601.0, "everything else": -771.0}
  assert train_step.parts_off_by(fine) == pytest.approx(8 / 108)
  assert train_step.parts_off_by(wild) == pytest.approx(771 / 108)
  size = {"first_loss": {"jax": 5.0, "torch": 5.0}, "ratio_recipe_vs_torch_compile": 1.0,
          "ratio_recipe_vs_torch_eager": 0.5, "ratio_recipe_bf16_vs_torch_compile_bf16": 1.0,
          "model": {"num_layers": 2}, "components_ms": {"recipe": fine, "torch_compile": wild},
          "components_add_up": {"recipe": True, "torch_compile": False}, "torch_targets": {}}
  train_step.print_torch("tiny", size)
  out = capsys.readouterr().out
  assert ("torch_compile: the parts sum to 879.00 ms against a 108.00 ms step (714% off, over "
          "15%): timed alone, they do not say where its step's time goes") in out
  assert "recipe: the parts" not in out


def test_torch_process_runs_steps_and_reports_a_failed_request(train_step):
  pytest.importorskip("torch")
  size = train_step.SIZES["quick"]
  model = train_step._init_fn(size.model)()
  batch = train_step.make_batch(size)
  spec = {**train_step.torch_spec(size, threads=1), "variants": {"torch_eager": [False, False]}}
  params = train_step._flat(train_step.nnx.state(model, train_step.nnx.Param))
  with train_step.torch_process.TorchProcess(spec, params, batch) as process:
    assert process.info["threads"] == 1
    with pytest.raises(RuntimeError, match="unknown op 'nope'"):
      process.call(op="nope")
    # Still serving after the error: the same first loss as JAX's, then a step.
    jax_loss = float(train_step.lm_loss(model, batch)[0])
    assert process.call(op="first_loss")["loss"] == pytest.approx(jax_loss, abs=1e-5)
    ran = process.call(op="run", variant="torch_eager", steps=2)
    assert ran["seconds"] > 0 and np.isfinite(ran["loss"])


def test_torch_process_says_when_the_child_dies_and_cleans_up(train_step, tmp_path, monkeypatch):
  monkeypatch.setattr(train_step.torch_process.tempfile, "tempdir", str(tmp_path))
  with pytest.raises(RuntimeError, match="the PyTorch process exited"):
    train_step.torch_process.TorchProcess({"no": "spec"}, {"w": np.zeros(2)}, {})
  assert list(tmp_path.iterdir()) == []  # The parameters' directory is removed.


def test_attention_quick_times_every_variant_and_names_auto_s_choice(tmp_path):
  results = _run_quick("attention", tmp_path, "--no-torch")
  times = results["times_ms"]
  assert {"reference", "auto", results["chosen"], results["fastest_eligible"]} <= set(times)
  assert all(ms > 0 for ms in times.values()), times
  assert results["request"]["causal"] and results["torch_sdpa"] == "--no-torch"


def test_sliding_window_quick_times_both_masks_with_the_kernel_auto_picks(tmp_path):
  results = _run_quick("sliding_window", tmp_path)
  assert set(results["times_ms"]) == {"causal", "windowed", "reference"}
  assert all(ms > 0 for ms in results["times_ms"].values())
  assert results["request"]["local_window"] == results["sliding_window"] - 1
  assert set(results["chosen"]) == {"causal", "windowed"}
  speedup = results["targets"]["windowed_speedup"]
  assert speedup["value"] == pytest.approx(
      results["times_ms"]["causal"] / results["times_ms"]["windowed"])


def test_common_target_says_by_how_much_a_figure_missed():
  common = _load("common")
  assert common.target(0.5, 0.5) == {"value": 0.5, "target": 0.5, "met": True, "missed_by": 0.0}
  missed = common.target(1.82, 1.0)
  assert not missed["met"] and missed["missed_by"] == pytest.approx(0.82)
  assert common.verdict(1.82, 1.0) == "MISSED by 82.0%"
  assert common.verdict(1.032, 1.03) == "MISSED by 0.2%"
  assert common.verdict(0.2, 0.25) == "met"
  short = common.target(0.45, 0.9, at_least=True)  # A throughput or an MFU: at least the limit.
  assert not short["met"] and short["missed_by"] == pytest.approx(0.5) and short["at_least"]
  assert common.verdict(0.95, 0.9, at_least=True) == "met"


def test_common_header_and_write(tmp_path, capsys):
  common = _load("common")
  assert set(common.header("x", device=False)) == {"benchmark", "python"}
  header = common.header("x")
  assert header["device"].startswith("cpu") and header["jax"]
  out = tmp_path / "new" / "x.json"
  common.write({**header, "figure": 1.5}, out)
  assert json.loads(out.read_text()) == {**header, "figure": 1.5}
  assert capsys.readouterr().out == f"wrote {out}\n"


def test_step_profile_quick_splits_the_step_s_op_time_by_kind(tmp_path):
  # Its own process: the per-op trace flag must be set before JAX starts.
  import subprocess

  out = tmp_path / "step_profile.json"
  done = subprocess.run([sys.executable, str(BENCHMARKS / "step_profile.py"), "--quick",
                         "--out", str(out)], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads(out.read_text())
  assert record["benchmark"] == "step_profile" and record["ops_timed"] > 10
  kinds = record["kinds"]
  assert kinds["matmul"]["ms"] > 0 and kinds["elementwise"]["ms"] > 0
  assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0)
  assert record["outside_matmuls_share"] == pytest.approx(1 - kinds["matmul"]["share"])
  assert any("dot_general" in op["source"] for op in record["top_ops"]["matmul"])


@pytest.mark.slow  # Five `jax-ai-stack train` children and the step's timings: ~40 s on 2 cores.
@pytest.mark.cpu_backend
def test_accelerator_quick_reports_every_section(tmp_path):
  # Its own process: it sets XLA_FLAGS and the allocator before JAX starts.
  import subprocess

  out = tmp_path / "accelerator.json"
  done = subprocess.run([sys.executable, str(BENCHMARKS / "accelerator.py"), "--quick",
                         "--out", str(out)], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  record = json.loads(out.read_text())
  assert record["benchmark"] == "accelerator" and record["device"].startswith("cpu")
  assert record["jaxlib"] and "jax_plugins" in record and "torch" in record
  for section in ("kernels", "attention", "model_step", "startup", "determinism", "resume",
                  "targets"):
    assert section in record, section
  assert record["kernels"]["chosen"] in record["kernels"]["fallbacks"]
  assert record["kernels"]["deterministic"] is True
  assert record["attention"]["times_ms"]["auto"] > 0
  step = record["model_step"]
  assert step["recipe_ms"] > 0 and step["mfu_measured"] > 0 and step["mfu_datasheet"] is None
  assert record["trainer_step_ms"] > 0
  assert record["startup"]["cold_first_step_s"] > 0 and record["startup"]["cached"]["cache_hits"] > 0
  determinism, resume = record["determinism"], record["resume"]
  assert determinism["identical_runs_bitwise"] is True, determinism
  assert determinism["steps_compared"] == 40 and determinism["throughput_ratio"] > 0
  assert resume["resumed_bitwise"] is True and resume["interrupted_exit_code"] == 143, resume
  assert 10 <= resume["stopped_at_step"] < 40
  targets = record["targets"]
  assert targets["two identical runs bitwise"]["met"] and targets["SIGTERM + resume bitwise"]["met"]
  assert targets["MFU / datasheet peak"] is None  # No datasheet peak for a CPU.
  assert targets["Trainer step / bare step"]["target"] == 1.05
  markdown = out.with_suffix(".md").read_text()
  assert markdown.startswith("cpu") and "| target | SIGTERM + resume bitwise | True |" in markdown


def test_accelerator_knows_datasheet_peaks_only_of_named_devices():
  accelerator = _load("accelerator")
  assert accelerator.datasheet_peak("NVIDIA H100 80GB HBM3") == 989.0
  assert accelerator.datasheet_peak("NVIDIA H200") == 989.0
  assert accelerator.datasheet_peak("NVIDIA A100-SXM4-40GB") == 312.0
  assert accelerator.datasheet_peak("NVIDIA H100 PCIe") is None  # 756, not 989: unknown.
  assert accelerator.datasheet_peak("cpu") is None


def test_accelerator_steady_step_leaves_out_compile_and_first_save():
  accelerator = _load("accelerator")
  # Step 1 (compile) at t=10, step 5 after the first save's copy, then 0.1 s a step.
  fetches = [[1, 10.0], [5, 12.0], [10, 12.5], [15, 13.0], [20, 13.6]]
  assert accelerator.steady_step_seconds(fetches) == pytest.approx(0.1)
  assert accelerator.steady_step_seconds(fetches[:2]) is None


def test_accelerator_children_get_no_deterministic_flag_from_the_parent():
  accelerator = _load("accelerator")
  environ = {"XLA_FLAGS": "--a=1 --xla_gpu_deterministic_ops=true --b", "HOME": "/h"}
  assert accelerator.without_deterministic_flag(environ) == {"XLA_FLAGS": "--a=1 --b", "HOME": "/h"}


def test_accelerator_bitwise_checks_need_equal_state_and_a_real_interruption():
  accelerator = _load("accelerator")
  run = {"losses": [[1, 5.0, 1.0]], "digest": "a", "steady_step_s": 0.1, "first_step_s": 3.0,
         "exit_code": 0}
  runs = {"cold": run, "cached": run, "nondeterministic": run}
  judged = accelerator.judge_runs(runs, {**run, "exit_code": 143, "digest": None}, run, 1)
  assert judged["determinism"]["identical_runs_bitwise"] and judged["resume"]["resumed_bitwise"]
  other = accelerator.judge_runs({**runs, "cached": {**run, "digest": "b"}},
                                 {**run, "exit_code": 0}, run, 1)
  assert not other["determinism"]["identical_runs_bitwise"]
  assert other["determinism"]["losses_bitwise"]  # Same losses, another state: not bitwise.
  assert not other["resume"]["resumed_bitwise"]  # The SIGTERM did not stop the run.


def test_attention_compares_torch_only_on_the_device_jax_runs_on(monkeypatch):
  import types

  attention = _load("attention")
  no_cuda = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
  with_cuda = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
  assert attention.torch_device(no_cuda, "cpu") == ("cpu", None)
  assert attention.torch_device(with_cuda, "gpu") == ("cuda", None)
  device, why = attention.torch_device(no_cuda, "gpu")
  assert device is None and "no CUDA device" in why
  device, why = attention.torch_device(with_cuda, "tpu")
  assert device is None and "does not run on tpu" in why
  # The timer itself: JAX on a GPU, torch without CUDA: no timer, and why.
  monkeypatch.setitem(sys.modules, "torch", no_cuda)
  request = attention.kernels.Request.from_shapes((1, 8, 2, 4), (1, 8, 2, 4), "float32")
  timer, why = attention.torch_sdpa_timer(request, None, platform="gpu")
  assert timer is None and "no CUDA device" in why


@pytest.mark.slow
@pytest.mark.cpu_backend
def test_accelerator_runs_only_the_sections_asked_and_writes_after_each(tmp_path):
  # A device lease too short for the five training runs still gets the step's figures.
  import subprocess

  out = tmp_path / "accelerator.json"
  done = subprocess.run([sys.executable, str(BENCHMARKS / "accelerator.py"), "--quick",
                         "--no-torch", "--sections", "kernels,step", "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "[accelerator] kernels:" in done.stderr and "[accelerator] step:" in done.stderr
  record = json.loads(out.read_text())
  assert record["sections"] == ["kernels", "step"] and set(record["seconds"]) == {"kernels", "step"}
  assert record["model_step"]["recipe_ms"] > 0 and "determinism" not in record
  assert record["targets"]["Trainer step / bare step"] is None
  markdown = out.with_suffix(".md").read_text()
  assert "| target | Trainer step / bare step | not measured here |" in markdown
  assert "first step, cold" not in markdown and "Attention forward+backward" not in markdown


def test_accelerator_names_an_unknown_section():
  import subprocess

  done = subprocess.run([sys.executable, str(BENCHMARKS / "accelerator.py"), "--sections",
                         "step,warmup"], capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and "unknown section(s) warmup" in done.stderr


def test_chunked_loss_quick_compares_the_heads_on_memory_time_and_values(tmp_path):
  results = _run_quick("chunked_loss", tmp_path)
  memory = results["bytes"]
  assert (memory["tiled"]["temporaries"] < memory["chunked"]["temporaries"]
          < memory["unchunked"]["temporaries"])
  assert memory["tiled"]["arguments"] == memory["unchunked"]["arguments"]
  for name in ("chunked", "tiled"):
    errors = results["relative_errors"][name]
    assert errors["loss"] < 1e-6 and errors["grad"] < 1e-5, name
  assert results["grad_relative_error"] == results["relative_errors"]["tiled"]["grad"]
  assert set(results["targets"]) == {"memory_ratio", "loss_relative_error",
                                     "grad_relative_error", "time_ratio"}
  assert results["targets"]["memory_ratio"]["value"] == pytest.approx(
      memory["tiled"]["temporaries"] / memory["unchunked"]["temporaries"])


@pytest.mark.slow
def test_engine_quick_gives_the_loop_s_tokens_and_reports_each_variant(tmp_path):
  results = _run_quick("engine", tmp_path, "--repeats", "2")
  quick = results["sizes"]["quick"]
  assert quick["same_tokens"] and quick["requests"] == 5 and quick["repeats"] == 2
  assert set(quick["tokens_per_s"]) == {"engine", "loop", "loop-batched"}
  assert all(rate > 0 for rate in quick["tokens_per_s"].values())
  assert 0 < quick["time_to_first_token_s"]["median"] <= quick["time_to_first_token_s"]["worst"]
  cache = quick["kv_cache_bytes"]
  assert cache["engine_pool"] < cache["full_length_per_request"]  # 2 slots for 5 requests.
  assert 0 < cache["engine_peak_held"] <= cache["engine_pool"]
  assert quick["engine_vs_best_loop"]["target"] == 3.0
  prefix = quick["prefix"]  # 4 requests of 24 shared tokens and 4 of their own, in bursts.
  assert prefix["same_tokens_and_logprobs"] and prefix["off"]["cached_tokens"] == 0
  assert prefix["on"]["cached_tokens"] >= 4 * 24  # The second burst's, at least.
  assert all(prefix[k][f"{b}_burst_s"] > 0 for k in ("off", "on") for b in ("first", "second"))


def test_harness_quick_scores_shared_contexts_packed_and_one_per_row_alike(tmp_path):
  results = _run_quick("harness", tmp_path)
  quick = results["sizes"]["quick"]
  assert quick["requests"] == 12 and quick["same_greedy"]
  assert 0 < quick["largest_loglikelihood_gap"] < 1e-4  # Shared contexts: other arithmetic.
  assert quick["padding_share"]["packed"] < quick["padding_share"]["one_per_row"]
  assert set(quick["requests_per_s"]) == {"shared_contexts", "packed", "one_per_row"}
  assert all(rate > 0 for rate in quick["requests_per_s"].values())
  assert quick["default"] == "shared_contexts"
  assert quick["best_other"] in ("packed", "one_per_row")
  assert quick["default_vs_other"]["target"] == 1.0


@pytest.mark.slow
def test_rl_quick_splits_the_step_and_compares_it_with_an_sft_step(tmp_path):
  results = _run_quick("rl", tmp_path)
  parts = results["seconds_per_step"]
  assert set(parts) == {"rollout", "engine", "scoring", "update", "reference", "sft"}
  assert all(seconds > 0 for seconds in parts.values())
  assert parts["engine"] < parts["rollout"]  # The engine's run is part of the rollout.
  assert results["rl_step_s"] == pytest.approx(parts["rollout"] + parts["scoring"]
                                               + parts["update"])
  assert results["rows"] == results["prompts"] * results["generations"] == 4
  assert results["engine_tokens_per_s"] > results["rollout_tokens_per_s"] > 0



@pytest.mark.slow  # About 30 s: a chat SFT and GRPO, each compiled (the engine's too).
def test_rl_demo_quick_reports_exact_answers_before_and_after_grpo(tmp_path):
  results = _run_quick("rl_demo", tmp_path)
  assert results["mode"] == "quick" and results["row"] in (None, "py3.11-cpu", "py3.12-cpu",
                                                            "py3.13-cpu")
  assert [e["step"] for e in results["evals"]] == [0, 2]
  assert results["exact_before"] == results["evals"][0]["eval_reward_exact_answer"]
  assert 0.0 <= results["exact_after"] <= 1.0
  assert results["gain"]["value"] == pytest.approx(results["exact_after"] - results["exact_before"])
  assert results["gain"]["target"] == 0.2 and results["gain"]["at_least"]
  assert "base" not in results and results["sft"]["steps"] == 4 and results["grpo"]["steps"] == 2
  assert results["sft"]["seconds"] > 0 and results["grpo"]["seconds"] > 0


def test_distill_quick_reports_both_students_held_out_loss_and_the_teacher_s(tmp_path):
  results = _run_quick("distill", tmp_path)
  assert results["mode"] == "quick"
  assert [results[k]["preset"] for k in ("teacher", "plain", "distilled")] == [
      "lm-small", "lm-tiny", "lm-tiny-distill"]
  for run in ("teacher", "plain", "distilled"):
    assert results[run]["steps"] == 4 and 0 < results[run]["eval_lm_loss"] < 10
  assert results["distilled"]["eval_loss"] != results["distilled"]["eval_lm_loss"]  # Half KL.
  assert results["distilled_minus_plain"] == pytest.approx(
      results["distilled"]["eval_lm_loss"] - results["plain"]["eval_lm_loss"])


def test_mechanisms_quick_times_each_attention_and_counts_what_decoding_keeps(tmp_path):
  results = _run_quick("mechanisms", tmp_path)
  assert set(results["step_ms"]) == {"plain", "sinks", "latent", "linear"}
  assert all(ms > 0 for ms in results["step_ms"].values()) and results["step_vs_plain"]["plain"] == 1
  cache = results["cache_bytes_per_layer"]  # d_model 64: 4 heads of 16, 2 KV heads, float32.
  assert cache["plain"] == {"per_token": 2 * 2 * 16 * 4, "per_sequence": 0}
  assert cache["latent"] == {"per_token": (2 * 16 + 16 // 4) * 4, "per_sequence": 0}
  state, conv = 4 * 16 * 16 * 4, 3 * (2 * 2 * 16 + 4 * 16) * 4  # 4 value heads; 3 past inputs.
  assert cache["linear"]["per_token"] == 0 and cache["linear"]["per_sequence"] == state + conv
  assert set(results["delta_rule_ms"]) == {"token_scan", "chunked"}


def _fake_trl(tmp_path: pathlib.Path, step_seconds: list[float]) -> str:
  """An 'interpreter' that imports trl and answers as trl_grpo.py does: 2 completions of 4
  tokens per prompt, the given step times."""
  reply = {"trl": "fake", "torch": "fake", "transformers": "fake", "threads": 2,
           "step_seconds": step_seconds,
           "part_seconds": {"rollout": [0.3] * 3, "generate": [0.2] * 3, "scoring": [0.01] * 3},
           "completion_lengths": [4] * 4 * 3}
  python = tmp_path / "python"
  python.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exit 0\necho '{json.dumps(reply)}'\n")
  python.chmod(0o755)
  return str(python)


@pytest.mark.slow  # About 20 s: a BPE tokenizer, import-hf and GRPO steps, compiled.
def test_rl_versus_trl_quick_measures_ours_and_compares_it_with_trl_s_step(tmp_path, capsys):
  results = _run_quick("rl", tmp_path, "--trl", "--torch-python",
                       _fake_trl(tmp_path, [9.0, 1.0, 3.0]))
  quick = results["sizes"]["quick"]
  ours, trl = quick["ours"], quick["trl"]
  assert results["versus"] == "trl" and results["steps"] == 2 and len(ours["step_seconds"]) == 3
  assert ours["step_s"] == pytest.approx(np.median(ours["step_seconds"][1:]))
  assert ours["step_s"] > 0
  assert 0 < ours["mean_completion_length"] <= 4  # rl.max_completion_tokens of the quick run.
  assert ours["seconds_per_step"]["engine"] < ours["seconds_per_step"]["rollout"]
  # Medians of the steps after the first.
  assert trl["step_s"] == 2.0 and trl["seconds_per_step"]["generate"] == 0.2
  assert quick["ours_vs_trl"]["value"] == pytest.approx(ours["step_s"] / 2.0)
  assert quick["ours_vs_trl"]["target"] == 0.5
  gap = abs(ours["mean_completion_length"] - 4) / 4
  assert quick["completion_length_gap"]["value"] == pytest.approx(gap)
  assert "ours / TRL" in capsys.readouterr().out


def test_rl_versus_trl_without_trl_says_so_in_one_line_and_measures_ours_alone(tmp_path, capsys):
  rl = _load("rl")
  assert rl.trl_python(str(tmp_path / "missing" / "python")) is None
  assert rl.trl_python(sys.executable if importlib.util.find_spec("trl") is None
                       else str(tmp_path / "missing")) is None
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2 and all(line.startswith("TRL's column skipped: ") for line in lines)
  assert "FileNotFoundError" in lines[0] and "--torch-python" in lines[0]


def test_rl_rewards_read_text_and_trl_s_messages_alike():
  trl_grpo = _load("trl_grpo")
  completions = ["yes, it is", [{"role": "assistant", "content": "No"}], "maybe"]
  assert trl_grpo.parity(None, completions, answer=["yes", "no", "no"]) == [1.0, 1.0, 0.0]
  assert trl_grpo.length(None, ["", "x" * 16, "x" * 99]) == [1.0, 0.75, 0.0]


@pytest.mark.slow
def test_structured_quick_times_every_variant_and_checks_the_outputs(tmp_path):
  pytest.importorskip("llguidance")
  results = _run_quick("structured", tmp_path)
  size = results["sizes"]["quick"]
  assert set(size["seconds_per_token"]) == {"free", "free-1", "structured"}
  assert all(v > 0 for v in size["seconds_per_token"].values())
  assert size["mask_seconds_per_token"] > 0 and size["valid_outputs"].endswith("/3")
  assert size["structured_vs_free"]["target"] == 1.2


def test_speculative_quick_times_each_variant_with_the_same_tokens(tmp_path):
  results = _run_quick("speculative", tmp_path)
  size = results["sizes"]["quick"]
  assert set(size["tokens_per_second"]) == {"plain", "lookup-2", "draft-2"}
  assert all(v > 0 for v in size["tokens_per_second"].values())
  assert size["same_tokens_as_plain"] == {"plain": True, "lookup-2": True, "draft-2": True}
  assert all(0 <= size["acceptance"][name] <= 1 for name in ("lookup-2", "draft-2"))
  assert 0 <= size["copy_accuracy"] <= 1 and 0 <= size["draft_copy_accuracy"] <= 1
  assert size["best_vs_plain"]["target"] == 1.5
