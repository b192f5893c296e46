"""`jax-ai-stack train | eval | generate` as a user runs them: the real command in a
subprocess, its exit codes, its one-line errors, and what it leaves in the workdir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jax_ai_stack.recipes import config, train
from jax_ai_stack.recipes.tasks.lm import SAMPLE_FILE

from multidevice import run_program
from training_helpers import STEPS, TINY, start_training, wait_for_step


def jax_ai_stack(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", *args], capture_output=True,
                        text=True, env=env, cwd=cwd, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 2, result.stdout + result.stderr
  lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  return lines[0]


def tree(path) -> dict:
  """Every file and folder under `path` with its size and mtime."""
  return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


def test_a_config_file_alone_merges_over_the_default_preset(tmp_path):
  partial = tmp_path / "my.yaml"
  partial.write_text("model: {num_layers: 2}\ntrain: {steps: 10}\n")
  result = jax_ai_stack("train", "--config", str(partial), "--print-config")
  assert result.returncode == 0, result.stderr
  printed = result.stdout
  assert "name: my" in printed and "num_layers: 2" in printed and "steps: 10" in printed
  assert "learning_rate: 0.003" in printed and "max_documents: 400" in printed  # The preset's.


def test_a_config_file_may_name_its_preset_or_none(tmp_path):
  other = tmp_path / "digits.yaml"
  other.write_text("preset: digits-cnn\ntrain: {steps: 7}\n")
  printed = jax_ai_stack("train", "--config", str(other), "--print-config").stdout
  assert "kind: cnn" in printed and "steps: 7" in printed
  bare = jax_ai_stack("train", "--preset", "none", "train.steps=3", "--print-config").stdout
  assert "name: custom" in bare and "steps: 3" in bare and "max_documents: null" in bare


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.attention_impl=cudnn", "train.steps=1"], "cudnn"),
        (["--config", "."], "is a directory"),
    ],
    ids=["kernel-not-on-this-backend", "config-is-a-directory"],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
  error = one_line_error(jax_ai_stack("train", "lm-tiny", *TINY, "--workdir", str(tmp_path / "w"),
                                      *args, cwd=tmp_path))
  assert message in error


def test_a_workdir_that_is_a_file_is_named(tmp_path):
  blocker = tmp_path / "runfile"
  blocker.write_text("")
  error = one_line_error(jax_ai_stack("train", "lm-tiny", *TINY, "--workdir", str(blocker)))
  assert "runfile is a file" in error


def test_a_bug_shows_its_traceback_and_exits_1(tmp_path):
  result = run_program("injected_bug", env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert result.returncode == 1
  assert "Traceback (most recent call last)" in result.stderr
  assert "ValueError: an injected bug" in result.stderr


def test_a_subcommand_s_bad_flag_shows_that_subcommand_s_usage():
  result = jax_ai_stack("doctor", "--bogus")
  assert result.returncode == 2
  assert "usage: jax-ai-stack doctor" in result.stderr and "--bogus" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_then_exits_with_its_code(tmp_path, sig, code):
  process = start_training(tmp_path, "checkpoint.save_every=1000", "train.steps=100000")
  wait_for_step(process, tmp_path, 2)
  process.send_signal(sig)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == code, output
  # It says what it does before the slow parts (corpus, compilation), not after.
  assert output.index("preparing data and model") < output.index("compiling the train step")
  assert f"({sig.name}); checkpoint saved" in output
  stopped_at = [r["step"] for r in train.read_metrics(tmp_path) if r["split"] == "train"][-1]
  trainer = train.Trainer.open_finished(tmp_path)
  trainer.close()
  assert trainer.step == stopped_at


@pytest.mark.slow
def test_eval_and_generate_read_a_run_without_writing(reference):
  workdir, _ = reference
  before = tree(workdir)
  result = jax_ai_stack("eval", "--workdir", str(workdir))
  assert result.returncode == 0, result.stderr
  assert '"step": 30' in result.stdout
  generated = jax_ai_stack("generate", "--workdir", str(workdir), "--prompt", "import ",
                           "--max-new-tokens", "1000")
  assert generated.returncode == 0, generated.stderr
  assert generated.stdout.startswith("import ")
  assert "generating 25 tokens, not 1000" in generated.stderr  # max_seq_len 32 - 7 prompt.
  default = jax_ai_stack("generate", "--workdir", str(workdir), "--prompt", "import ")
  assert default.returncode == 0, default.stderr
  assert "note:" not in default.stderr  # The default length is what fits: nothing to note.
  assert len(default.stdout.rstrip("\n")) > len("import ")
  assert tree(workdir) == before


def test_a_finished_run_always_has_its_artefacts(reference, tmp_path):
  workdir, _ = reference
  killed = tmp_path / "killed-after-the-last-save"
  shutil.copytree(workdir, killed)
  (killed / train.PLOT_FILE).unlink()
  (killed / SAMPLE_FILE).unlink()
  result = jax_ai_stack("train", "lm-tiny", *TINY, f"train.steps={STEPS}", "--workdir", str(killed))
  assert result.returncode == 0, result.stderr
  assert "nothing to do" in result.stdout
  assert (killed / train.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
  assert (killed / SAMPLE_FILE).read_text(encoding="utf-8").startswith("def ")


@pytest.mark.slow
def test_generate_seed_repeats_a_sample_and_no_seed_draws_a_new_one(reference):
  workdir, _ = reference
  generate = lambda *args: jax_ai_stack("generate", "--workdir", str(workdir), "--prompt", "im",
                                        "--max-new-tokens", "20", "--temperature", "1.5", *args)
  seeded = [generate("--seed", "7", "--top-k", "40", "--top-p", "0.95") for _ in range(2)]
  assert all(r.returncode == 0 for r in seeded), seeded[0].stderr
  assert seeded[0].stdout == seeded[1].stdout
  unseeded = generate()
  assert unseeded.returncode == 0, unseeded.stderr
  seed = int(unseeded.stderr.split("(seed ")[1].split(":")[0])  # Printed, to repeat it.
  assert generate("--seed", str(seed)).stdout == unseeded.stdout
  assert one_line_error(generate("--top-p", "1.5")).endswith("--top-p must be in (0, 1]; got 1.5")


@pytest.mark.parametrize("count", ["0", "-5"])
def test_generate_refuses_no_new_tokens_before_opening_the_run(tmp_path, count):
  error = one_line_error(jax_ai_stack("generate", "--workdir", str(tmp_path / "none"),
                                      "--max-new-tokens", count))
  assert error.endswith(f"--max-new-tokens must be at least 1; got {count}")


def test_train_list_describes_each_preset():
  result = jax_ai_stack("train", "--list")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == len(config.list_presets())
  default = next(line for line in lines if line.startswith("lm-tiny (default)"))
  assert "byte-level Llama" in default
  assert all(len(line.split(None, 1)) == 2 for line in lines)  # A name, then its description.


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.2, 0.5, 1.5, 3.0])
def test_ctrl_c_at_any_moment_of_start_up_is_exit_130_without_a_traceback(tmp_path, after_s):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  process = subprocess.Popen(
      [sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", *TINY, "--workdir",
       str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  try:
    time.sleep(after_s)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
  finally:
    process.kill()
  assert process.returncode == 130, out + err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("command, first", [
    (["eval"], "evaluating"), (["generate"], "generating"),
    (["quantize", "--scheme", "w8"], "quantizing"), (["export-hf", "OUT"], "exporting"),
    (["lora", "merge"], "merging")])
def test_on_a_terminal_each_command_says_what_it_does_at_once(reference, tmp_path, command,
                                                                first):
  import pty
  import select

  workdir, _ = reference
  argv = [w.replace("OUT", str(tmp_path / "out")) for w in command] + ["--workdir", str(workdir)]
  terminal, stderr = pty.openpty()
  started = time.monotonic()
  process = subprocess.Popen([sys.executable, "-m", "jax_ai_stack.cli", *argv],
                             stdout=subprocess.DEVNULL, stderr=stderr,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    ready, _, _ = select.select([terminal], [], [], 10)
    waited = time.monotonic() - started
    line = os.read(terminal, 1000).decode() if ready else ""
  finally:
    process.kill()
    process.wait()
    os.close(terminal)
    os.close(stderr)
  assert line.startswith(first), line
  assert waited < 3, f"{waited:.1f} s before the first line (1 s on a quiet machine)"


def test_a_reward_module_that_does_not_import_is_one_line_and_leaves_no_workdir(tmp_path):
  """It was named after the model was built and compiled, leaving config.yaml, record.json,
  an empty metrics.jsonl and checkpoints/."""
  result = jax_ai_stack("train", "lm-tiny-grpo", "rl.rewards=[my_rewardz:parity]",
                        "rl.reward_weights=null", "--workdir", str(tmp_path / "run"),
                        cwd=tmp_path)
  assert "rl.rewards='my_rewardz:parity' does not import" in one_line_error(result)
  assert "compiling" not in result.stdout
  assert not (tmp_path / "run").exists()


def test_a_dry_run_imports_the_rewards_as_training_would(tmp_path):
  planned = jax_ai_stack("train", "lm-tiny-grpo", "rl.rewards=[my_rewardz:parity]",
                         "rl.reward_weights=null", "--dry-run", cwd=tmp_path)
  assert "rl.rewards='my_rewardz:parity' does not import" in one_line_error(planned)
