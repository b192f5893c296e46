"""`training_helpers.finish_both` on a mesh: JAX fixes its device count at start, so a run on
8 simulated devices trains in its own interpreter. Prints both runs' state digests as JSON.

Arguments: the preset, the overrides (a JSON list), the whole run's and the killed run's
workdirs."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training_helpers import finish_both  # noqa: E402  (after the tests' folder is on the path)

preset, overrides, whole, killed = sys.argv[1:]
print(json.dumps(finish_both(preset, json.loads(overrides), pathlib.Path(whole),
                             pathlib.Path(killed))))
