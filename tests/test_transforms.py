"""Model transforms: a chain runs its transforms in order, and the ones a recipe asks for
(QAT, LoRA, a base with a frozen DPO reference) change what trains, is saved and decodes."""

from __future__ import annotations

import pytest
from flax import nnx

from jax_ai_stack.recipes import config as config_lib
from jax_ai_stack.recipes.finetune import reference, transforms as finetune_transforms
from jax_ai_stack.recipes.tasks.lm import LanguageModel
from jax_ai_stack.recipes.transforms import Chain, Frozen, ModelTransform, TransformConflict

TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "model.max_seq_len=32", "data.seq_len=16"]


class _Tag(ModelTransform):
  """Records its name on the model; narrows `wrt`, gives a reference or a Qwix provider
  when asked."""

  def __init__(self, name, wrt=nnx.Param, reference=None, qwix=None):
    self.name, self.wrt, self.ref, self.qwix_provider = name, wrt, reference, qwix
    self.provides_reference = reference is not None

  @property
  def label(self):
    return f"tag {self.name}"

  def apply(self, model):
    model.tags = (*getattr(model, "tags", ()), self.name)
    return model

  def metadata(self):
    return {self.name: 1}

  def reference_model(self, model):
    return self.ref


def test_a_chain_applies_in_order_and_takes_the_one_narrowing_and_reference():
  chain = Chain([_Tag("a"), _Tag("b", wrt=nnx.LoRAParam, reference="b's"), _Tag("c")])
  model = chain.apply(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
  assert model.tags == ("a", "b", "c")
  assert chain.wrt is nnx.LoRAParam and Chain([_Tag("a")]).wrt is nnx.Param
  assert chain.metadata() == {"a": 1, "b": 1, "c": 1}
  assert chain.reference_model(model) == "b's" and Chain([_Tag("a")]).reference_model(model) is None
  assert chain.provides_reference and not Chain([_Tag("a")]).provides_reference


@pytest.mark.parametrize("first, second, claim", [
    (dict(wrt=nnx.LoRAParam), dict(wrt=nnx.LoRAParam), "narrow what trains"),
    (dict(reference="x"), dict(reference="y"), "give the reference model"),
    (dict(qwix="QtProvider"), dict(qwix="LoraProvider"), "apply a Qwix provider"),
])
def test_a_chain_refuses_two_transforms_that_claim_the_same_thing(first, second, claim):
  with pytest.raises(TransformConflict, match=f"tag b and tag d each {claim}"):
    Chain([_Tag("a"), _Tag("b", **first), _Tag("c"), _Tag("d", **second)])


@pytest.mark.parametrize("overrides, trains, reference_kept, compares", [
    ([], nnx.Param, False, False),
    (["finetune.base=runs/x"], nnx.Param, False, False),
    (["finetune.base=runs/x", "finetune.lora={rank: 4}"], nnx.LoRAParam, False, False),
    (["data.source=preference_stdlib", "finetune.base=runs/x"], nnx.Param, True, True),
    (["data.source=preference_stdlib", "finetune.base=runs/x", "finetune.lora={rank: 4}"],
     nnx.LoRAParam, False, True),  # The reference: the adapters switched off.
])
def test_what_a_recipe_asks_changes_what_trains_and_what_is_saved(overrides, trains,
                                                                   reference_kept, compares):
  config = config_lib.load("lm-tiny", overrides=[*TINY, *overrides])
  chain = finetune_transforms.for_config(config)
  assert chain.wrt is trains
  task = LanguageModel(config)
  model = nnx.eval_shape(lambda: chain.apply(task.build_model(0)))
  state = nnx.state(model)
  assert bool(nnx.state(model, Frozen)) == reference_kept
  assert not nnx.state(chain.saved(state), Frozen)  # A frozen copy is never saved.
  decoding = chain.inference_model(model, lambda: task.build_model(0)) if trains is nnx.Param \
      else model
  assert not nnx.state(decoding, Frozen)
  # Only an objective that compares with the base gets it (a distillation's is its teacher).
  assert (chain.reference_model(model) is not None) == compares


def test_the_frozen_copy_is_laid_out_like_the_weights():
  """Same shapes and logical axes, so a mesh splits each copy like its weight."""
  model = nnx.eval_shape(lambda: reference.add_frozen_copy(
      LanguageModel(config_lib.load("lm-tiny", overrides=TINY)).build_model(0)))
  params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  frozen = dict(nnx.to_flat_state(nnx.state(model, Frozen)))
  assert len(frozen) == len(params)
  for path, weight in params.items():
    copy = frozen[(reference.ATTRIBUTE, *map(str, path))]
    assert copy.get_value().shape == weight.get_value().shape
    assert copy.get_metadata().get("out_sharding") == weight.get_metadata().get("out_sharding")
  assert any(w.get_metadata().get("out_sharding") for w in params.values())
