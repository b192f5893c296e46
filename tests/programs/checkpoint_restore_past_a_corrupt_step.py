"""A restore as the CLI does it: in a fresh interpreter absl's and TensorStore's output is seen.

argv: the checkpoint folder."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_checkpoint import _abstract, checkpoint  # noqa: E402

manager = checkpoint.build_manager(sys.argv[1], checkpoint.CheckpointConfig())
restored = checkpoint.restore(manager, _abstract(), capture_stderr=True)  # As the CLI.
print("restored", restored.step)
