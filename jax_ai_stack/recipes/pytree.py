"""Small helpers for naming and re-keying pytrees of parameters."""

from __future__ import annotations

from typing import Any


def path_str(path) -> str:
  """A readable 'a/b/0/c' name for a jax key path (dict keys, attributes, indices)."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def stringify_keys(tree: Any) -> Any:
  """Nested dicts with every key a string (how Orbax stores them)."""
  if isinstance(tree, dict):
    return {str(k): stringify_keys(v) for k, v in tree.items()}
  return tree


def rekey_like(reference: Any, tree: Any) -> Any:
  """`tree` (string keys) with the key types of `reference` (e.g. ints back)."""
  if isinstance(reference, dict):
    return {k: rekey_like(v, tree[str(k)]) for k, v in reference.items()}
  return tree
