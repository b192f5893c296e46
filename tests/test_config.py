"""Recipe configs: presets, YAML files, dotted overrides, round trips, clear errors."""

from __future__ import annotations

import pytest

from jax_ai_stack.recipes import config, configlib
from multidevice import run_program


def test_every_preset_loads_and_validates():
  presets = config.list_presets()
  assert {"lm-tiny", "lm-small", "digits-cnn"} <= set(presets)
  for name in presets:
    loaded = config.load(name)
    assert loaded.name == name


def test_overrides_in_both_forms():
  overrides = configlib.parse_overrides(["--model.num_layers", "2", "optim.learning_rate=1e-3"])
  loaded = config.load("lm-tiny", overrides=overrides)
  assert loaded.model.num_layers == 2
  assert loaded.optim.learning_rate == 1e-3


def test_yaml_round_trip(tmp_path):
  original = config.load("lm-tiny", overrides=["model.num_layers=3", "data.packing=true"])
  path = tmp_path / "recipe.yaml"
  path.write_text(configlib.to_yaml(original))
  assert config.load(None, config_file=path) == original


def test_config_file_merges_over_the_preset(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text("train:\n  steps: 7\n")
  loaded = config.load("lm-tiny", config_file=path)
  assert loaded.train.steps == 7
  assert loaded.model.num_layers == config.load("lm-tiny").model.num_layers


def test_a_config_file_alone_merges_over_the_default_preset(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text("model:\n  num_layers: 2\ntrain:\n  steps: 10\n")
  loaded, preset = config.load(config_file=path), config.load(config.DEFAULT_PRESET)
  assert loaded.name == "mine"  # Named after the file: its runs/<name> is not lm-tiny's.
  assert config.load(config.DEFAULT_PRESET, config_file=path).name == config.DEFAULT_PRESET
  assert loaded.model.num_layers == 2 and loaded.model.d_model == preset.model.d_model
  assert loaded.train.steps == 10 and loaded.optim == preset.optim and loaded.data == preset.data


def test_a_config_file_names_its_base_preset(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text("preset: digits-cnn\ntrain:\n  steps: 10\n")
  assert config.load(config_file=path).model.kind == "cnn"
  path.write_text("preset: none\ntrain:\n  steps: 10\n")
  assert config.load(config_file=path) == config.RecipeConfig(name="mine",
                                                             train=config.TrainConfig(steps=10))
  assert config.load("lm-tiny", config_file=path).name == "lm-tiny"  # The argument wins.


def test_a_model_of_another_kind_replaces_the_preset_s_model(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text("model:\n  kind: cnn\n  hidden: 32\ndata:\n  source: digits\n")
  loaded = config.load("lm-tiny", config_file=path)
  assert loaded.model.kind == "cnn" and loaded.model.hidden == 32


def test_configs_are_frozen():
  loaded = config.load("lm-tiny")
  with pytest.raises(Exception, match="cannot assign"):
    loaded.train.steps = 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.num_layer=2"], "unknown field 'model.num_layer'; did you mean 'model.num_layers'"),
        (["optim.learnig_rate=1"], "did you mean 'optim.learning_rate'"),
        (["data.seq_len=abc"], "field 'data.seq_len'.*got 'abc'"),
        (["model.num_kv_heads=3"], "num_kv_heads=3 must divide num_heads=4"),
        (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len"),
        (["data.source=digits"], "does not go with data.source='digits'"),
        (["train.steps=0"], "train.steps must be >= 1"),
        (["model.attention_impl=fastest"], "model.attention_impl: unknown attention implementation 'fastest'"),
    ],
)
def test_bad_overrides_name_the_field(overrides, message):
  with pytest.raises(configlib.ConfigError, match=message):
    config.load("lm-tiny", overrides=overrides)


def test_unknown_preset_lists_the_presets():
  with pytest.raises(configlib.ConfigError, match="unknown preset 'nope'; presets: deepseek_v3-tiny, digits-cnn"):
    config.load("nope")


def test_broken_yaml_names_file_and_line(tmp_path):
  path = tmp_path / "broken.yaml"
  path.write_text("train:\n  steps: 7\n  bad: [1, 2\n")
  with pytest.raises(configlib.ConfigError, match=rf"{path}:\d+:\d+: not valid YAML"):
    config.load("lm-tiny", config_file=path)


def test_missing_config_file_is_named(tmp_path):
  with pytest.raises(configlib.ConfigError, match="nope.yaml: file not found"):
    config.load("lm-tiny", config_file=tmp_path / "nope.yaml")


def test_malformed_override_is_rejected():
  with pytest.raises(configlib.ConfigError, match="not of the form"):
    configlib.parse_overrides(["model.num_layers"])
  with pytest.raises(configlib.ConfigError, match="has no value"):
    configlib.parse_overrides(["--model.num_layers"])


def test_field_docstrings_become_descriptions():
  from jax_ai_stack.recipes.optim import OptimConfig

  assert "Peak learning rate" in OptimConfig.__pydantic_fields__["learning_rate"].description


HEAVY_MODULES = ("jax", "jaxlib", "flax", "optax", "grain", "orbax", "tensorstore", "tokamax",
                 "qwix")

def test_loading_and_printing_a_config_imports_no_heavy_library():
  """`train --print-config` and `--list` stay fast: the config is pure Python."""
  result = run_program("config_imports", check=True)
  imported = set(result.stdout.split()) & set(HEAVY_MODULES)
  assert not imported, f"loading a config imported {sorted(imported)}"


def test_a_saved_config_without_vocab_multiple_reads_as_unpadded():
  """Checkpoints written before the vocabulary was padded have vocab_size rows."""
  saved = configlib.to_dict(config.load("lm-tiny"))
  del saved["model"]["vocab_multiple"]
  assert config.from_json(saved).model.vocab_multiple == 1
  assert config.from_json(configlib.to_dict(config.load("lm-tiny"))).model.vocab_multiple == 128
  cnn = configlib.to_dict(config.load("digits-cnn"))
  assert config.from_json(cnn) == config.load("digits-cnn")


def test_an_override_sets_a_field_of_an_optional_group_left_unset():
  """import-hf's config.yaml spells `lora: null`; `finetune.lora.rank=16` fills it in."""
  data = configlib.apply_overrides({"finetune": {"base": "runs/a", "lora": None}},
                                   ["finetune.lora.rank=16"])
  assert data == {"finetune": {"base": "runs/a", "lora": {"rank": 16}}}
  with pytest.raises(configlib.ConfigError, match="'base' is not a group of fields"):
    configlib.apply_overrides(data, ["finetune.base.rank=1"])


@pytest.mark.parametrize("preset, fraction", [("lm-tiny", 0.05), ("digits-cnn", 0.2)])
def test_the_printed_config_says_what_a_derived_default_resolves_to(preset, fraction, tmp_path):
  """`--print-config` showed `validation_fraction: null` where 0.05 applied."""
  loaded = config.load(preset)
  text = config.printed(loaded)
  assert f"  validation_fraction: null  # {fraction} applies\n" in text
  assert ("  head_dim: null  # 32 applies\n" in text) == (preset == "lm-tiny")
  assert "  lora: null\n" in text  # Null without a derived value: no comment.
  saved = tmp_path / "printed.yaml"
  saved.write_text(text)
  assert config.load(config.NO_PRESET, config_file=saved) == loaded  # Loads back unchanged.
