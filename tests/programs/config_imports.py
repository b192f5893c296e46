"""Configs loaded and printed, then what was imported: only a fresh interpreter starts empty."""

import sys

from jax_ai_stack import cli
from jax_ai_stack.recipes import config, configlib

cli.build_parser()  # Every subcommand registers itself: what --help and --list pay for.
configlib.to_yaml(config.load("lm-tiny", overrides=["train.steps=3", "model.attention_impl=xla"]))
configlib.to_yaml(config.load("digits-cnn"))
try:
  config.load("lm-tiny", overrides=["model.attention_impl=fastest"])
except configlib.ConfigError:
  pass
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
