"""Flax NNX models of the recipes: `llama` (decoder LM) and `cnn` (image classifier)."""
