"""The `slow` marker says what it should: every test that took over SLOW_S seconds has it.

CI runs the suite minus `slow` on a second Python, so an unmarked slow test costs minutes
there. conftest marks each test whose recorded time is over SLOW_S; a test that must run on
every row all the same (it proves what differs between jax versions: the multi-process path)
says so with `every_row`. The durations come from a recorded whole-suite run on a CI-sized
machine (`pytest -n auto --record-durations tests/durations.json`).
"""

import json
import pathlib
import subprocess
import sys

from conftest import DURATIONS_FILE, SLOW_S


def test_every_test_over_the_limit_is_marked_slow(request):
  recorded = json.loads(DURATIONS_FILE.read_text())
  unmarked = sorted(f"{item.nodeid} ({recorded[item.nodeid]:.0f} s)"
                    for item in request.session.items
                    if recorded.get(item.nodeid, 0.0) > SLOW_S
                    and item.get_closest_marker("slow") is None
                    and item.get_closest_marker("every_row") is None)
  assert not unmarked, (f"took over {SLOW_S:.0f} s in {DURATIONS_FILE.name} and marked neither "
                        "@pytest.mark.slow nor every_row:\n" + "\n".join(unmarked))


def test_not_slow_leaves_out_a_recorded_slow_test_its_file_does_not_mark():
  recorded = json.loads(DURATIONS_FILE.read_text())
  path = "tests/test_generate_docs.py"  # Quick to collect; no test in it says `slow` itself.
  assert "mark.slow" not in pathlib.Path(DURATIONS_FILE.parent, pathlib.Path(path).name).read_text()
  slow = [nodeid for nodeid, seconds in recorded.items()
          if nodeid.startswith(path + "::") and seconds > SLOW_S]
  assert slow, f"no test of {path} over {SLOW_S} s in {DURATIONS_FILE.name}: pick another file"
  listed = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       "-n", "0", "-m", "not slow", path],
      cwd=DURATIONS_FILE.parent.parent, capture_output=True, text=True, check=True).stdout
  assert path + "::" in listed  # Its quick tests are collected ...
  assert not [nodeid for nodeid in slow if nodeid in listed]  # ... and not its slow ones.


def test_the_recorded_durations_are_of_this_suite(request):
  recorded = json.loads(DURATIONS_FILE.read_text())
  collected = {item.nodeid for item in request.session.items}
  if len(collected) < 300:  # A file or a few tests were selected: nothing to compare.
    return
  known = len(collected & recorded.keys()) / len(collected)
  assert known > 0.8, (f"only {known:.0%} of the collected tests are in {DURATIONS_FILE.name}: "
                       "record it again")
