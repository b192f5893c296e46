"""A word wherever the user waits: `train` and `generate` run in-process, off a terminal, with
every wait said at once (`progress.QUIET_S` 0): the status lines on stderr in the order of
the phases, plain lines (no carriage return), and `generate`'s closing summary consistent
with what it printed."""

from __future__ import annotations

import contextlib
import io
import json
import re

import jax
import pytest

from jax_ai_stack import cli
from jax_ai_stack.recipes import progress

from training_helpers import TINY

pytestmark = pytest.mark.slow  # Two tiny trainings and their compiles (~40 s on 2 cores).

SUMMARY = re.compile(r"generated (\d+) tokens(?: for (\d+) requests)? in ([\d.]+) s: "
                     r"([\d.]+) tokens/s, first token after ([\d.]+) s"
                     r"(?: \(mean; at most ([\d.]+) s\))?")


def _run(*argv: str) -> tuple[int, str, str]:
  """`jax-ai-stack ARGV` in this process: exit status, stdout, stderr."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


def _in_order(lines: list[str], *patterns: str) -> list[int]:
  """The index of the first line matching each pattern, after the previous one's."""
  at, found = -1, []
  for pattern in patterns:
    at = next((i for i in range(at + 1, len(lines)) if re.search(pattern, lines[i])), None)
    assert at is not None, f"{pattern!r} not after line {found[-1:]} in:\n" + "\n".join(lines)
    found.append(at)
  return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Two tiny runs of one config sharing a fresh compilation cache (cold, then warm), and
  the cold one's workdir for `generate`."""
  tmp = tmp_path_factory.mktemp("waits")
  names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
  before = {name: getattr(jax.config, name) for name in names}
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(progress, "QUIET_S", 0.0)
    patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp / "xla"))  # generate's "auto".
    argv = ["train", "lm-tiny", *TINY, "train.steps=2", "train.eval_every=0",
            f"train.compile_cache={tmp / 'xla'}"]
    cold = _run(*argv, "--workdir", str(tmp / "cold"))
    warm = _run(*argv, "--workdir", str(tmp / "warm"))
    yield {"cold": cold, "warm": warm, "workdir": tmp / "cold", "patch": patch}
  for name, value in before.items():
    jax.config.update(name, value)
  from jax.experimental.compilation_cache import compilation_cache as cc

  cc.reset_cache()


def test_train_says_each_phase_in_order_and_whether_the_cache_served_it(runs):
  code, out, err = runs["cold"]
  assert code == 0, out + err
  _in_order(out.splitlines(), r"preparing data and model", r"compiling the train step",
            r"^sample:", r"^done: step 2")
  _in_order(err.splitlines(),
            r"^tracing \S*train_step\S* \.\.\.$", r"^traced \S*train_step\S* in [\d.]+ s$",
            r"^compiling jit\(\S*train_step\S*\) \.\.\.$",
            r"^compiled jit\(\S*train_step\S*\) in [\d.]+ s \(not in the compilation cache\)$",
            r"^sampling 8 tokens \.\.\.$",
            r"^sampled \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\)$")
  assert "\r" not in out + err  # Off a terminal: lines, never a bar's frames.
  code, out, err = runs["warm"]
  assert code == 0, out + err
  _in_order(err.splitlines(),
            r"^compiled jit\(\S*train_step\S*\) in [\d.]+ s \(loaded from the compilation cache\)$")


def _summary(err: str) -> re.Match:
  last = err.strip().splitlines()[-1]
  match = SUMMARY.fullmatch(last)
  assert match, f"the last line of stderr is no summary: {last!r}\n{err}"
  return match


def test_generate_says_what_it_waits_on_and_ends_with_a_consistent_summary(runs):
  jax.clear_caches()  # As a new process would: the train run's sample compiled the same.
  code, out, err = _run("generate", "--workdir", str(runs["workdir"]), "--prompt", "im",
                        "--max-new-tokens", "5", "--ignore-eos", "--seed", "3")
  assert code == 0, out + err
  _in_order(err.splitlines(), r"^opening the run \.\.\.$", r"^generating \.\.\.$",
            r"^compiling jit\(\S+\) \.\.\.$", r"^compiled jit\(\S+\) in [\d.]+ s \(",
            r"^generated ")
  tokens, requests, total_s, rate, first_s, _ = _summary(err).groups()
  assert int(tokens) == 5 and requests is None  # --ignore-eos: all that were asked for.
  assert 0 < float(first_s) <= float(total_s)
  shown = float(total_s)  # To 0.1 s: the rate was computed from the unrounded time.
  assert 5 / (shown + 0.05) - 0.05 <= float(rate) <= 5 / max(shown - 0.05, 1e-9) + 0.05
  assert out.startswith("im") and "\r" not in out + err


def test_generate_input_reports_the_totals_of_its_requests(runs, tmp_path):
  requests = tmp_path / "requests.jsonl"
  requests.write_text('{"prompt": "a"}\n{"prompt": "def f", "stop": ["\\n"]}\n'
                      '{"messages": [{"role": "user", "content": "hi"}]}\n')
  code, out, err = _run("generate", "--workdir", str(runs["workdir"]), "--input",
                        str(requests), "--max-new-tokens", "6", "--seed", "1")
  assert code == 0, out + err
  results = [json.loads(line) for line in out.splitlines()]
  assert sorted(r["index"] for r in results) == [0, 1, 2]
  assert all(set(r) == {"index", "text", "finish_reason", "tokens"} for r in results)
  tokens, count, total_s, _, mean_s, most_s = _summary(err).groups()
  assert int(tokens) == sum(r["tokens"] for r in results) and int(count) == 3
  assert 0 < float(mean_s) <= float(most_s) <= float(total_s)
  assert "\r" not in out + err
