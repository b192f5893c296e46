"""Several processes, one job: `jax-ai-stack train` on 2 processes x 2 CPU devices.

The processes meet on 127.0.0.1 through `jax.distributed` (CPU collectives over
Gloo), exactly as hosts of a cluster would. The same recipe on 1 process with 4
devices (the same global mesh and batch) is the reference.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes import checkpoint, distributed, train
from jax_ai_stack.recipes import config as config_lib
from training_helpers import records

STEPS = 40
RECIPE = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2",
    "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=16", "data.batch_size=8",
    "data.max_documents=30", "data.validation_fraction=0.2", "train.eval_every=20",
    "train.eval_batches=2", "train.sample_tokens=8", "train.progress=false",
    "checkpoint.save_every=20", "optim.warmup_steps=2", f"train.steps={STEPS}",
    "mesh.data=1", "mesh.fsdp=-1", "mesh.rules=fsdp",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _train(workdir: pathlib.Path, *flags: str, devices: int, preset: str = "lm-tiny",
           recipe: tuple[str, ...] = tuple(RECIPE)) -> subprocess.Popen:
  command = [sys.executable, "-m", "jax_ai_stack.cli", "train", preset, "--workdir",
             str(workdir), *recipe, *flags]
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
             JAX_ENABLE_COMPILATION_CACHE="false")  # The processes compile one program at once.
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env)


def _start_job(workdir: pathlib.Path, *flags: str, processes: int = 2, **recipe
               ) -> list[subprocess.Popen]:
  """`recipe`: `_train`'s preset and recipe."""
  address = f"127.0.0.1:{_free_port()}"
  return [_train(workdir, *flags, "--coordinator", address, "--num-processes", str(processes),
                 "--process-id", str(i), devices=2, **recipe) for i in range(processes)]


def _finish(job: list[subprocess.Popen]) -> list[tuple[int, str]]:
  results = []
  for process in job:
    try:
      output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      for p in job:
        p.kill()
      pytest.fail("a process of the job did not finish in time")
    results.append((process.returncode, output))
  return results


def _losses(workdir: pathlib.Path) -> list[float]:
  return [r["loss"] for r in train.read_metrics(workdir) if r["split"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
  """The recipe on one process with 4 devices."""
  workdir = tmp_path_factory.mktemp("one-process")
  [(code, output)] = _finish([_train(workdir, devices=4)])
  assert code == 0, output
  return workdir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[pathlib.Path, list[tuple[int, str]]]:
  workdir = tmp_path_factory.mktemp("two-processes")
  return workdir, _finish(_start_job(workdir))


@pytest.mark.every_row
def test_two_processes_train_like_one_process_with_the_same_devices(reference, two_processes):
  """Same global mesh, batch and program; the all-reduce crosses processes (Gloo)
  and may sum in another order, so float32 losses may differ in the last bits."""
  workdir, results = two_processes
  for code, output in results:
    assert code == 0, output
    assert "4 device(s)" in output and f"done: step {STEPS}" in output
  np.testing.assert_allclose(_losses(workdir), _losses(reference), rtol=2e-5)
  assert len(_losses(workdir)) == STEPS  # Only process 0 wrote the log: no duplicate lines.
  for name in ("loss.png", "sample.txt"):
    assert (workdir / name).is_file()


def _signal_one_process_after_step_3(workdir: pathlib.Path, signum: int, *flags: str) -> int:
  """Starts the job, sends `signum` to process 1 after step 3, checks that both
  processes stopped after the same step and saved it; returns that step."""
  job = _start_job(workdir, *flags)
  deadline = time.monotonic() + 180
  while not (workdir / "metrics.jsonl").exists() or len(_losses(workdir)) < 3:
    if any(p.poll() is not None for p in job) or time.monotonic() > deadline:
      pytest.fail("the job ended or hung before step 3: "
                  + "\n".join(output for _, output in _finish(job)))
    time.sleep(0.02)
  job[1].send_signal(signum)
  stopped = set()
  for process_id, (code, output) in enumerate(_finish(job)):
    [line] = [line for line in output.splitlines() if line.startswith("stopped at step")]
    stopped.add(line.split(" (")[0])
    if signum == signal.SIGINT and process_id == 1:
      assert code == 130 and "(SIGINT)" in line, output
    else:
      assert code == 75 and "(preemption)" in line, output  # Run again to resume.
  assert len(stopped) == 1, stopped  # Both saved the same step.
  step = int(next(iter(stopped)).split()[3])
  assert 3 <= step < STEPS
  manager = checkpoint.build_manager(workdir / train.CHECKPOINT_DIR, checkpoint.CheckpointConfig(),
                                     read_only=True)
  assert manager.latest_step() == step
  manager.close()
  return step


@pytest.mark.every_row
def test_sigint_to_one_process_stops_both_at_the_same_step_not_a_hang(tmp_path):
  """Ctrl-C in one host's terminal: that process alone must not stop (the other
  would wait for it in the next collective forever)."""
  _signal_one_process_after_step_3(tmp_path / "interrupted", signal.SIGINT)


@pytest.mark.every_row
def test_sigterm_to_one_process_stops_both_at_the_same_step_and_resume_is_bitwise(
    tmp_path, two_processes):
  workdir = tmp_path / "preempted"
  # SIGTERM to one process, as a cluster preempting one host.
  step = _signal_one_process_after_step_3(workdir, signal.SIGTERM)

  for code, output in _finish(_start_job(workdir)):  # Both processes again: they resume.
    assert code == 0, output
    assert f"resumed from step {step}" in output
  uninterrupted, _ = two_processes
  # Each checkpoint (written on 4 devices by 2 processes) restores in this single process.
  resumed, expected = (train.Trainer.open_finished(workdir, optimizer_state=True),
                       train.Trainer.open_finished(uninterrupted, optimizer_state=True))
  try:
    assert resumed.step == expected.step == STEPS
    assert checkpoint.tree_equal(resumed.state, expected.state)
  finally:
    resumed.close()
    expected.close()
  assert _losses(workdir) == _losses(uninterrupted)


@pytest.mark.slow
def test_a_job_resumed_with_the_other_layer_layout_converts_on_every_process(tmp_path):
  """The step is read as saved (unrolled, sharded over both processes' devices) and
  moved, parameter by parameter, into the stacked layout on the same mesh."""
  workdir = tmp_path / "layout"
  short = ("optim.schedule=constant", "checkpoint.save_every=2", "train.eval_every=0")
  for code, output in _finish(_start_job(workdir, *short, "train.steps=4")):
    assert code == 0, output
  for code, output in _finish(_start_job(workdir, *short, "train.steps=6",
                                         "model.scan_layers=true")):
    assert code == 0, output
    assert "resumed from step 4" in output and "done: step 6" in output
    assert "checkpoint step 4 has the unrolled layout; converted to scanned" in output, output
  losses = _losses(workdir)
  assert len(losses) == 6 and np.all(np.isfinite(losses))


@pytest.mark.slow
def test_two_processes_train_from_a_token_cache_as_from_memory(tmp_path, two_processes):
  """Each process reads only its rows from the cache: the same batches, the same losses."""
  cache = tmp_path / "tokens"
  prepared = subprocess.run(
      [sys.executable, "-m", "jax_ai_stack.cli", "data", "prepare", "lm-tiny", *RECIPE,
       "--cache", str(cache), "--quiet"], capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert prepared.returncode == 0, prepared.stderr
  workdir = tmp_path / "from-cache"
  address = f"127.0.0.1:{_free_port()}"
  job = [_train(workdir, f"data.cache={cache}", "--coordinator", address, "--num-processes", "2",
                "--process-id", str(i), devices=2) for i in range(2)]
  for code, output in _finish(job):
    assert code == 0, output
  in_memory, _ = two_processes
  assert _losses(workdir) == _losses(in_memory)


# ---- a process dies: the others stop within the heartbeat timeout ---------------


def _sigkill_one_process_while_training(workdir: pathlib.Path, victim: int
                                        ) -> tuple[int, float, str]:
  """Starts a long job, SIGKILLs process `victim` once a checkpoint is on disk;
  returns the survivor's exit code, seconds from the kill to its exit, output."""
  # Still training when killed; a checkpoint every 2 steps.
  job = _start_job(workdir, "train.steps=100000", "checkpoint.save_every=2")
  try:
    deadline = time.monotonic() + 50
    while distributed.latest_saved_step(workdir / train.CHECKPOINT_DIR) is None:
      if any(p.poll() is not None for p in job) or time.monotonic() > deadline:
        pytest.fail("the job ended or hung before its first checkpoint")
      time.sleep(0.05)
    job[victim].kill()
    killed = time.monotonic()
    survivor = job[1 - victim]
    output, _ = survivor.communicate(timeout=40)
    return survivor.returncode, time.monotonic() - killed, output
  except subprocess.TimeoutExpired:
    pytest.fail("the survivor did not stop within 40 s of its peer's death")
  finally:
    for p in job:
      p.kill()
      p.communicate()


@pytest.mark.every_row
@pytest.mark.parametrize("victim, named", [
    (1, "process 1 of 2 stopped answering (heartbeat timeout 10 s)"),
    (0, "process 0 of 2 (the coordinator, 127.0.0.1:"),
], ids=["process-1-killed", "coordinator-killed"])
def test_a_killed_process_stops_the_other_within_15_s_naming_it(tmp_path, victim, named):
  """SIGKILL (or a lost host) saves nothing; the survivor must not wait JAX's 100 s
  heartbeat timeout, nor die of the runtime's abort: one line, exit status 69."""
  workdir = tmp_path / "killed"
  code, seconds, output = _sigkill_one_process_while_training(workdir, victim)
  assert code == distributed.PEER_LOST_EXIT_CODE == 69, output
  assert seconds < 15, (seconds, output)
  last = output.strip().splitlines()[-1]
  assert last.startswith(f"jax-ai-stack train: error: {named}"), output
  step = distributed.latest_saved_step(workdir / train.CHECKPOINT_DIR)
  assert f"the last checkpoint (step {step}) is kept in {workdir}" in last, last
  assert last.endswith("start every process again to resume"), last


@pytest.mark.parametrize("process_id, coordinator_answers, processes, message", [
    (0, True, 2, "process 1 of 2 stopped answering (heartbeat timeout 7 s)"),
    (1, False, 2, "process 0 of 2 (the coordinator, h:1) stopped answering"),
    (2, False, 4, "process 0 of 4 (the coordinator, h:1) stopped answering"),
    (1, True, 2, "the coordinator reported this process (1 of 2) lost"),
    (0, True, 3, "a process of 3 stopped answering (heartbeat timeout 7 s; process 0's log"),
])
def test_the_line_for_a_lost_process_names_it(tmp_path, process_id, coordinator_answers,
                                              processes, message):
  lost = distributed.PeerLost(process_id, processes, "h:1", 7, tmp_path / "checkpoints")
  assert lost.message(coordinator_answers=coordinator_answers).startswith(message)
  assert "no checkpoint was saved yet in" in lost.message(coordinator_answers=True)
  for step in ("2", "10", "12.orbax-checkpoint-tmp-5"):  # The last: a step being written.
    (tmp_path / "checkpoints" / step).mkdir(parents=True)
  assert distributed.latest_saved_step(tmp_path / "checkpoints") == 10
  assert (f"the last checkpoint (step 10) is kept in {tmp_path / 'checkpoints'}; start every "
          "process again to resume") in lost.message(coordinator_answers=True)


def test_the_pinned_jax_takes_the_heartbeat_timeout():
  """`initialize` passes these by name: a jax that renames them fails here, not on a cluster."""
  import inspect

  import jax

  parameters = inspect.signature(jax.distributed.initialize).parameters
  assert {"initialization_timeout", "heartbeat_timeout_seconds"} <= parameters.keys()
  launch = distributed.Launch.from_flags("auto")
  assert (launch.timeout_s, launch.heartbeat_timeout_s) == (120, 10)  # The documented defaults.


# ---- joining the job: bad input ------------------------------------------------


def _run_cli(*flags: str, timeout: int = 60) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "jax_ai_stack.cli", "train", "lm-tiny", *flags],
                        capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_an_unreachable_coordinator_is_a_named_error_not_a_hang(tmp_path):
  address = f"127.0.0.1:{_free_port()}"  # Nobody serves it.
  result = _run_cli("--workdir", str(tmp_path / "run"), "--coordinator", address,
                    "--num-processes", "2", "--process-id", "1", "--distributed-timeout", "2")
  assert result.returncode == 2, result.stderr
  assert f"could not reach the coordinator at {address} within 2s" in result.stderr
  assert not (tmp_path / "run").exists()  # Nothing was created.


def test_a_coordinator_port_in_use_is_a_named_error(tmp_path):
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    result = _run_cli("--workdir", str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{port}",
                      "--num-processes", "2", "--process-id", "0")
  assert result.returncode == 2, result.stderr
  assert f"port {port} is not free" in result.stderr


def test_distributed_auto_without_a_cluster_says_what_to_give(tmp_path):
  result = _run_cli("--workdir", str(tmp_path / "run"), "--distributed", "auto")
  assert result.returncode == 2, result.stderr
  assert "found no cluster" in result.stderr and "--coordinator HOST:PORT" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (dict(coordinator="h:1"), "missing: --num-processes, --process-id"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), "--process-id must be in [0, 2)"),
    (dict(coordinator="nohost", num_processes=2, process_id=0), "HOST:PORT"),
    (dict(distributed="auto", process_id=0), "--process-id given with --distributed auto"),
    (dict(distributed="cluster"), "must be off, auto or explicit"),
    (dict(distributed="auto", timeout_s=0), "--distributed-timeout must be >= 1"),
    (dict(distributed="auto", heartbeat_timeout_s=1), "--heartbeat-timeout must be >= 2"),
])
def test_flags_that_do_not_fit_together_are_usage_errors(flags, message):
  with pytest.raises(UsageError) as error:
    distributed.Launch.from_flags(flags.pop("distributed", None), **flags)
  assert message in str(error.value)


def test_one_process_is_the_default_and_joins_nothing():
  launch = distributed.Launch.from_flags(None)
  assert launch.mode == "off" and launch.describe() == "one process"
  distributed.initialize(launch)  # Returns at once: no coordinator involved.
  assert distributed.is_primary()  # The only process writes the run's files.


MIXTURE = ("data.mixture={components: {logs: {paths: ['logging/*']}, js: {paths: ['json/*']}}, "
           "stages: [{step: 0, weights: {logs: 3, js: 1}}, {step: 10, weights: {js: 1}}]}",
           "data.batch_schedule=[{step: 15, batch_size: 16}]", "train.steps=30",
           "train.eval_every=30")


@pytest.mark.slow
def test_a_mixture_and_a_batch_schedule_on_two_processes_train_like_one_and_resume_bitwise(
    tmp_path):
  """Each process deals only its own rows of each step, whatever the step's size; together
  they are one process's. A job preempted before the size changes resumes bitwise."""
  [(code, output)] = _finish([_train(tmp_path / "one", *MIXTURE, devices=4)])
  assert code == 0, output
  for code, output in _finish(_start_job(tmp_path / "two", *MIXTURE)):
    assert code == 0, output
  np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=2e-5)
  [evaluated] = [r for r in train.read_metrics(tmp_path / "two") if r["split"] == "eval"]
  assert {"eval_logs_loss", "eval_js_loss"} <= set(evaluated)

  step = _signal_one_process_after_step_3(tmp_path / "preempted", signal.SIGTERM, *MIXTURE)
  for code, output in _finish(_start_job(tmp_path / "preempted", *MIXTURE)):
    assert code == 0, output
  assert _losses(tmp_path / "preempted") == _losses(tmp_path / "two")


# ---- reinforcement learning: each process samples its own prompts -------------------

GRPO = ("model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "train.progress=false", "train.sample_tokens=0")
"""The base's model (lm-tiny's context: the chat prompts need it)."""
GRPO_STEPS = 6
GRPO_RUN = (*GRPO, "data.max_documents=200", "data.validation_fraction=0.1",
            "data.batch_size=4", "rl.num_generations=4", "rl.max_completion_tokens=6",
            "rl.rewards=[test_rl_rewards:distinct_characters]", "rl.reward_weights=null",
            "train.eval_every=3", "train.eval_batches=1", "checkpoint.save_every=1",
            "train.log_every=1", "optim.learning_rate=0.01", f"train.steps={GRPO_STEPS}",
            "mesh.data=1", "mesh.fsdp=-1", "mesh.rules=fsdp")


@pytest.mark.slow
def test_a_grpo_job_on_two_processes_killed_and_resumed_equals_the_job_that_never_stopped(
    tmp_path, monkeypatch):
  """Each process samples the groups of its own prompts on a whole copy of the policy (the
  parameters are sharded over both); a SIGKILL of one (during a rollout or an update) stops
  the other, and both started again end bitwise where the job that never stopped did."""
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
      str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH")])))  # The reward.
  base = tmp_path / "base"
  train.run(config_lib.load("lm-tiny", overrides=[*GRPO, "data.max_documents=30",
                                                  "train.steps=2", "train.eval_every=0"]),
            base)
  recipe = {"preset": "lm-tiny-grpo", "recipe": (*GRPO_RUN, f"finetune.base={base}")}
  for code, output in _finish(_start_job(tmp_path / "whole", **recipe)):
    assert code == 0, output
    assert "4 device(s)" in output and f"done: step {GRPO_STEPS}" in output
  whole = records(tmp_path / "whole", "train")
  assert [r["step"] for r in whole] == list(range(1, GRPO_STEPS + 1))
  assert all(r["sampler_logp_gap"] < 1e-5 for r in whole)  # The copy is the policy.
  assert any(r["grad_norm"] > 0 for r in whole) and all(r["reward"] > 0 for r in whole)

  killed = tmp_path / "killed"
  job = _start_job(killed, **recipe)
  deadline = time.monotonic() + 180
  while not (killed / "metrics.jsonl").exists() or len(_losses(killed)) < 3:
    if any(p.poll() is not None for p in job) or time.monotonic() > deadline:
      pytest.fail("the job ended or hung before step 3: "
                  + "\n".join(output for _, output in _finish(job)))
    time.sleep(0.02)
  job[1].kill()
  job[1].communicate()
  [(code, output)] = _finish(job[:1])  # The survivor.
  assert code == distributed.PEER_LOST_EXIT_CODE, output
  saved = distributed.latest_saved_step(killed / train.CHECKPOINT_DIR)
  assert saved is not None and saved < GRPO_STEPS
  for code, output in _finish(_start_job(killed, **recipe)):
    assert code == 0, output
    assert f"resumed from step {saved}" in output
  assert records(killed, "train") == whole  # Every reward, loss and gradient.
  assert records(killed, "eval") == records(tmp_path / "whole", "eval")
  resumed, expected = (train.Trainer.open_finished(killed, optimizer_state=True),
                       train.Trainer.open_finished(tmp_path / "whole", optimizer_state=True))
  try:
    assert checkpoint.tree_equal(resumed.state, expected.state)
  finally:
    resumed.close()
    expected.close()


@pytest.mark.slow
def test_harness_tasks_during_training_on_two_processes_come_from_process_0(tmp_path):
  """Every process takes a whole copy of the sharded model; process 0 runs the harness on its
  copy and the others receive its metrics: both finish, the log has them once."""
  from test_evaluation_harness import write_tasks

  tasks = write_tasks(tmp_path / "tasks")
  flags = ("train.steps=20", "train.eval_every=10", f"train.eval_tasks=[{tasks}]",
           "train.eval_tasks_limit=3", "checkpoint.save_every=10")
  for code, output in _finish(_start_job(tmp_path / "run", *flags)):
    assert code == 0, output
    assert "eval_harness_tiny_sums_acc" in output  # Printed by each process.
  evals = [r for r in train.read_metrics(tmp_path / "run") if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [10, 20]
  assert all(0 <= r["eval_harness_tiny_sums_acc"] <= 1 for r in evals)
