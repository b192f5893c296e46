"""Lazy package attributes: loaded on first use, unknown names are AttributeErrors."""

import sys

import pytest

from jax_ai_stack.lazy import lazy_attributes


def test_a_submodule_loads_only_when_asked_for():
  sys.modules.pop("email.quoprimime", None)
  getattr_, dir_ = lazy_attributes("email", ["quoprimime"], {"body_length": "quoprimime"})
  assert "email.quoprimime" not in sys.modules
  assert getattr_("body_length")(b"abc") == 3
  assert "email.quoprimime" in sys.modules
  assert dir_() == ["body_length", "quoprimime"]


def test_an_unknown_name_is_an_attribute_error_naming_the_package():
  getattr_, _ = lazy_attributes("email", ["quoprimime"])
  with pytest.raises(AttributeError, match="module 'email' has no attribute 'nope'"):
    getattr_("nope")


def test_a_moved_name_loads_its_new_module_with_a_deprecation_warning():
  getattr_, dir_ = lazy_attributes("email", ["charset"], moved={"qp": "quoprimime"})
  with pytest.warns(DeprecationWarning, match="email.qp moved to email.quoprimime"):
    module = getattr_("qp")
  assert module.__name__ == "email.quoprimime"
  assert dir_() == ["charset"]


def test_a_renamed_name_gives_what_took_its_place_with_a_deprecation_warning():
  getattr_, dir_ = lazy_attributes("json", ["decoder"], renamed={"Decoder": "json.JSONDecoder"})
  with pytest.warns(DeprecationWarning, match=r"json.Decoder is deprecated: use json.JSONDecoder"):
    assert getattr_("Decoder") is sys.modules["json"].JSONDecoder
  assert dir_() == ["decoder"]
