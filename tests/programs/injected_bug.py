"""`train --print-config` with a bug injected: a fresh interpreter to patch, and its exit code."""

import sys

from jax_ai_stack import cli
from jax_ai_stack.recipes import config


def broken(*args, **kwargs):
  raise ValueError("an injected bug")  # A ValueError too: not a user error.


config.load = broken
sys.exit(cli.main(["train", "--print-config"]))
