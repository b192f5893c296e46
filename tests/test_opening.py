"""`opening`: a finished run opened to read, before any model exists. (Opening to train:
through `train.run` in test_train.py, refused input and `resume=never` included.)"""

from __future__ import annotations

from jax_ai_stack.recipes import opening

from training_helpers import tiny_config

SETTINGS = dict(environ={}, task=None, capture_stderr=False)


def test_a_finished_run_opens_read_only_with_its_saved_config(reference):
  workdir = reference[0]
  opened = opening.open_finished(workdir, overrides=("data.validation_fraction=0.2",),
                                 validation=False, **SETTINGS)
  try:
    assert opened.restore and opened.train_data is None and opened.validation is None
    assert opened.config.data.validation_fraction == 0.2
    assert opened.config.train.steps == tiny_config().train.steps
  finally:
    opened.manager.close()
