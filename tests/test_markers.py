"""The `slow` marker says what it should: every test that took over SLOW_S seconds has it.

CI runs the suite minus `slow` on every matrix row but one, so an unmarked slow test
costs minutes on each row. A test that must run on every row all the same (it proves
what differs between jax versions: the multi-process path) says so with `every_row`.
The durations come from a recorded whole-suite run on a CI-sized machine
(`pytest -n auto --record-durations tests/durations.json`).
"""

import json

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


def test_the_recorded_durations_are_of_this_suite(request):
  recorded = json.loads(DURATIONS_FILE.read_text())
  collected = {item.nodeid for item in request.session.items}
  if len(collected) < 300:  # A file or a few tests were selected: nothing to compare.
    return
  known = len(collected & recorded.keys()) / len(collected)
  assert known > 0.8, (f"only {known:.0%} of the collected tests are in {DURATIONS_FILE.name}: "
                       "record it again")
