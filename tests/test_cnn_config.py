"""The CNN's config: shapes that do not fit are refused naming the field; YAML round trip."""

from __future__ import annotations

import pytest
import yaml

from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.cnn_config import CNNConfig


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(channels=(8, 16, 32, 64)), r"image_shape=\(8, 8, 1\).*divisible by 16"),
        (dict(channels=()), "channels must name at least one conv layer"),
    ],
)
def test_config_rejects_inconsistent_shapes(fields, message):
  with pytest.raises(ValueError, match=message):
    CNNConfig(**fields)
  with pytest.raises(configlib.ConfigError, match=message):
    configlib.from_dict(CNNConfig, fields)


def test_config_errors_name_the_field():
  with pytest.raises(configlib.ConfigError, match=r"'dropout'.*less than 1.*1\.0"):
    configlib.from_dict(CNNConfig, {"dropout": 1.0})
  with pytest.raises(configlib.ConfigError, match=r"'image_shape\.2': Field required"):
    configlib.from_dict(CNNConfig, {"image_shape": [8, 8]})
  with pytest.raises(configlib.ConfigError, match="did you mean 'num_classes'"):
    configlib.from_dict(CNNConfig, {"num_class": 3})


def test_config_round_trips_through_yaml():
  config = CNNConfig(image_shape=(16, 16, 3), channels=(4, 8), dropout=0.25)
  loaded = configlib.from_dict(CNNConfig, yaml.safe_load(configlib.to_yaml(config)))
  assert loaded == config and isinstance(loaded.channels, tuple)
