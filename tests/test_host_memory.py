"""The host's memory as read from /proc and the control group, and a run refused before its
weights load where its state alone exceeds it."""

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import host_memory


def _files(tmp_path, meminfo, *limits):
  (tmp_path / "meminfo").write_text(meminfo)
  paths = []
  for i, text in enumerate(limits):
    paths.append(tmp_path / f"limit{i}")
    paths[-1].write_text(text)
  return tmp_path / "meminfo", tuple(paths) + (tmp_path / "absent",)


@pytest.mark.parametrize("limits, want", [
    ((), (8 << 30, "meminfo's MemTotal")),
    (("max\n",), (8 << 30, "meminfo's MemTotal")),
    (("9223372036854771712\n",), (8 << 30, "meminfo's MemTotal")),  # cgroup v1: no limit.
    (("2147483648\n",), (2 << 30, "limit0")),
    (("4294967296\n", "1073741824\n"), (1 << 30, "limit1")),
])
def test_the_host_s_memory_is_the_smaller_of_memtotal_and_the_cgroup_s_limit(tmp_path, limits,
                                                                             want):
  meminfo, paths = _files(tmp_path, "MemTotal:        8388608 kB\nMemFree: 12 kB\n", *limits)
  got = host_memory.host_memory(meminfo, paths)
  assert got[0] == want[0] and got[1].endswith(want[1])


def test_a_host_that_says_nothing_has_no_limit_and_nothing_is_refused(tmp_path):
  assert host_memory.host_memory(tmp_path / "none", (tmp_path / "nor",)) is None
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(host_memory, "host_memory", lambda: None)
    host_memory.check_fits({"parameters": 1 << 50})  # Nothing to compare with: no refusal.


def test_a_state_over_the_host_names_each_part_and_the_limit_s_source():
  parts = {"parameters": 3 << 30, "optimizer state": 6 << 30, "gradients": 3 << 30}
  host_memory.check_fits(parts, limit=(16 << 30, "MemTotal"))
  with pytest.raises(ConfigError, match=r"needs at least 12.00 GiB of host memory \(parameters "
                     r"3.00 GiB, optimizer state 6.00 GiB, gradients 3.00 GiB\) .* the 8.00 GiB "
                     r"this host has \(MemTotal\)"):
    host_memory.check_fits(parts, limit=(8 << 30, "MemTotal"))
  host_memory.check_fits(parts, processes=2, limit=(8 << 30, "MemTotal"))  # 6 GiB a host.


def test_a_run_too_large_for_the_host_is_refused_before_any_state_exists(tmp_path, monkeypatch):
  from jax_ai_stack.recipes import config, train

  from training_helpers import tiny_config

  monkeypatch.setattr(host_memory, "host_memory", lambda: (1 << 20, "a small test host"))
  with pytest.raises(ConfigError, match=r"parameters [\d.]+ MiB, optimizer state [\d.]+ MiB, "
                     r"gradients [\d.]+ MiB\) before any activations, more than the 1.00 MiB "
                     r"this host has \(a small test host\)"):
    train.run(config.load("lm-tiny", overrides=["train.steps=1", "data.max_documents=30"]),
              tmp_path / "run")
  assert not any((tmp_path / "run" / "checkpoints").glob("*")), "nothing saved"
  monkeypatch.setattr(host_memory, "host_memory", lambda: (1 << 40, "a large test host"))
  assert train.run(tiny_config(), tmp_path / "fits")["step"] > 0
