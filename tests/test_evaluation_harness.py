"""`jax-ai-stack eval --tasks`: lm-evaluation-harness tasks from local files on a trained run,
and each bad input in one line."""

import json
import os
import subprocess
import sys

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.evaluation import harness, stdlib_tasks
from training_helpers import TINY

MULTIPLE_CHOICE = """task: tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GENERATE = """task: tiny_calls
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: [")"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(directory, *, missing_data=False):
  directory.mkdir(parents=True, exist_ok=True)
  sums = [{"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a * b + 7}"], "answer": 0}
          for a, b in [(1, 2), (2, 3), (3, 4), (4, 5)]]
  calls = [{"prompt": f"def f{i}(", "target": "x"} for i in range(3)]
  for name, rows, template in (("sums", sums, MULTIPLE_CHOICE), ("calls", calls, GENERATE)):
    data = directory / f"{name}.jsonl"
    if not missing_data:
      data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{name}.yaml").write_text(template.format(data=data))
  return directory


def jax_ai_stack(*args):
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", *args], capture_output=True,
                        text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("evaluated") / "run"
  result = jax_ai_stack("train", "lm-tiny", "--workdir", str(workdir), *TINY,
                        "model.max_seq_len=64", "train.steps=2", "train.sample_tokens=0")
  assert result.returncode == 0, result.stderr
  return workdir


@pytest.mark.slow
def test_eval_runs_local_tasks_and_the_embedded_ones_and_writes_the_harness_results(
    workdir, tmp_path):
  tasks = write_tasks(tmp_path / "tasks")
  result = jax_ai_stack("eval", "--workdir", str(workdir), "--tasks", f"{tasks},stdlib",
                        "--limit", "3")
  assert result.returncode == 0, result.stderr
  assert "tiny_sums" in result.stdout and "exact_match" in result.stdout  # The table.
  [written] = (workdir / "eval_harness").glob("results-step2-*.json")
  results = json.loads(written.read_text())["results"]
  assert 0 <= results["tiny_sums"]["acc,none"] <= 1
  assert results["tiny_calls"]["exact_match,none"] in (0, 1 / 3, 2 / 3, 1)
  assert json.loads(written.read_text())["n-samples"]["tiny_sums"]["effective"] == 3
  assert set(results) == {"tiny_sums", "tiny_calls", *stdlib_tasks.TASKS}  # Made offline.
  copy = workdir / "eval_harness" / "stdlib_tasks"  # Theirs to read and change.
  assert f"tasks {copy}" in result.stderr
  assert sorted(p.stem for p in copy.glob("*.yaml")) == sorted(stdlib_tasks.TASKS)


@pytest.mark.slow  # lm-eval indexes its thousands of task files.
def test_an_unknown_task_lists_the_close_ones():
  with pytest.raises(ConfigError, match="no task 'hellaswg' in lm-eval; close: hellaswag"):
    harness.resolve(["hellaswg"])


def test_a_directory_without_a_task_file_is_named(tmp_path):
  (tmp_path / "notes.yaml").write_text("just: a mapping\n")
  (tmp_path / "broken.yaml").write_text("task: [unclosed\n")
  with pytest.raises(ConfigError, match="no task YAML file") as caught:
    harness.task_files(tmp_path)
  assert "notes.yaml: no 'task:' name" in str(caught.value)
  assert "broken.yaml: not YAML" in str(caught.value)


@pytest.mark.slow
def test_a_task_file_runs_its_task_with_the_harness_standard_errors(workdir, tmp_path):
  """A file was refused as "no such directory", and every Stderr was N/A (bootstrap_iters=0
  turned off even a mean's closed form)."""
  tasks = write_tasks(tmp_path / "tasks")
  before = set((workdir / "eval_harness").glob("*.json"))
  result = jax_ai_stack("eval", "--workdir", str(workdir), "--tasks", str(tasks / "sums.yaml"))
  assert result.returncode == 0, result.stderr
  [written] = set((workdir / "eval_harness").glob("results-step2-*.json")) - before
  results = json.loads(written.read_text())["results"]
  assert set(results) == {"tiny_sums"}  # Its one task, not its folder's.
  acc, stderr = results["tiny_sums"]["acc,none"], results["tiny_sums"]["acc_stderr,none"]
  assert stderr == pytest.approx((acc * (1 - acc) / 3) ** 0.5)  # The mean's, 4 examples.
  assert "N/A" not in result.stdout and "Stderr N/A" not in result.stderr


def test_a_misspelled_name_is_answered_with_the_local_tasks_first(tmp_path, monkeypatch):
  write_tasks(tmp_path / "my_tasks")
  monkeypatch.chdir(tmp_path)
  known = {"arc_it", "tiny_sumz_lm_eval", "hellaswag"}
  close = harness._close("tiny_sumz", {}, known)  # pylint: disable=protected-access
  assert close.startswith("; close: tiny_sums (my_tasks/sums.yaml)"), close
  assert close.endswith("tiny_sumz_lm_eval")  # lm-eval's after.
  assert harness._close("stdlb", {}, known) == "; close: stdlib"  # pylint: disable=protected-access
  with pytest.raises(ConfigError, match=r"--tasks my_tasks/sum.yaml: no such file or directory; "
                                        r"close: my_tasks/sums.yaml"):
    harness.prepare(["my_tasks/sum.yaml"], tmp_path)


def test_a_note_says_why_a_stderr_is_missing():
  results = {"results": {"a": {"acc,none": 0.5, "acc_stderr,none": 0.1,
                               "exact_match,none": 1.0, "exact_match_stderr,none": "N/A"}}}
  assert harness.stderr_note(results).startswith("Stderr N/A (exact_match): lm-eval has no")
  assert harness.stderr_note({"results": {"a": {"acc_stderr,none": 0.1}}}) is None


@pytest.mark.parametrize("flags, words", [
    (["--tasks", "./no/such/dir"], "--tasks ./no/such/dir: no such file or directory"),
    (["--tasks", "my_tasks/parity.yaml"], "--tasks my_tasks/parity.yaml: no such file or directory"),
    (["--tasks", "x", "--limit", "0"], "--limit must be above 0"),
    (["--tasks", "x", "data.batch_size=2"], "--tasks takes no data overrides"),
])
def test_bad_input_is_one_line_and_exit_2_and_the_workdir_is_untouched(workdir, flags, words):
  before = sorted(p.name for p in workdir.iterdir())
  result = jax_ai_stack("eval", "--workdir", str(workdir), *flags)
  assert result.returncode == 2 and words in result.stderr, result.stderr
  assert "Traceback" not in result.stderr
  assert sorted(p.name for p in workdir.iterdir()) == before


@pytest.mark.slow
def test_a_task_whose_data_is_not_on_disk_says_so(workdir, tmp_path):
  tasks = write_tasks(tmp_path / "tasks", missing_data=True)
  result = jax_ai_stack("eval", "--workdir", str(workdir), "--tasks", str(tasks))
  assert result.returncode == 2, result.stderr
  assert "the data is not on disk" in result.stderr and "Traceback" not in result.stderr
