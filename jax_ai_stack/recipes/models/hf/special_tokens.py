"""The tokenizer's special-token ids of a Hugging Face directory, carried through a run unchanged.

config.json's `bos_token_id`, `eos_token_id` and `pad_token_id` (a list where the
file has one, None where it says null) and generation_config.json are the
tokenizer's, not the model's: `import-hf` keeps them beside the copied
tokenizer.json (`keep`), and `export-hf` writes them back as they came
(`for_export`). The ids that end a completion (`end_ids`) are generation_config.json's
`eos_token_id` where the source had one, exactly; where it had none, config.json's
EOS (or the tokenizer's) and the end-of-turn tokens that `generate --chat` stops at,
which the export's generation_config.json then lists. `generate` stops at the same
ids, so that transformers' `generate` on the export stops where ours does. A run
whose tokenizer came without them (a tokenizer.json alone) exports the ids the
tokenizer found.

Example:
  >>> ids, generation = for_export("no/such/dir/tokenizer.json", bos=1, eos=2, pad=0,
  ...                              end_of_turn=[2, 7])
  >>> ids, generation["eos_token_id"]
  ({'bos_token_id': 1, 'eos_token_id': 2, 'pad_token_id': 0}, [2, 7])
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

from jax_ai_stack.recipes.models.hf.layout import CONFIG_FILE

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
IDS_FILE = "special_token_ids.json"
"""Beside an imported tokenizer.json: the source config.json's TOKEN_KEYS, as they were."""
GENERATION_FILE = "generation_config.json"


def keep(source: str | os.PathLike, directory: str | os.PathLike) -> None:
  """Keeps `source`'s token ids (config.json) and generation_config.json in `directory`."""
  source, directory = pathlib.Path(source), pathlib.Path(directory)
  config = json.loads((source / CONFIG_FILE).read_text(encoding="utf-8"))
  ids = {key: config[key] for key in TOKEN_KEYS if key in config}
  if ids:
    (directory / IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
  if (source / GENERATION_FILE).is_file():
    shutil.copyfile(source / GENERATION_FILE, directory / GENERATION_FILE)


def end_ids(tokenizer: str | os.PathLike | None, *, eos: int,
            end_of_turn: Sequence[int]) -> list[int]:
  """The ids that end a completion of a run whose tokenizer is the file `tokenizer` (None: a
  tokenizer without one): the `eos_token_id` of the generation_config.json kept beside it,
  as the source wrote it; else the kept config.json's `eos_token_id` (else `eos`, the
  tokenizer's), then the `end_of_turn` ids it lacks."""
  kept = _kept(tokenizer)
  stops = kept[GENERATION_FILE].get("eos_token_id")
  if stops is not None:
    return _listed(stops)
  stops = _listed(kept[IDS_FILE].get("eos_token_id", eos))
  return stops + [i for i in end_of_turn if i not in stops]


def for_export(tokenizer: str | os.PathLike, *, bos: int, eos: int, pad: int,
               end_of_turn: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(config.json's token ids, generation_config.json) for a run whose tokenizer is the file
  `tokenizer`: what was kept beside it, else the ids the tokenizer found (`bos`, ...); a
  generation_config.json made here (or one without `eos_token_id`) ends at `end_ids`."""
  kept = _kept(tokenizer)
  ids = kept[IDS_FILE] or {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
  generation = dict(kept[GENERATION_FILE]) or {
      key: value for key, value in ids.items() if value is not None}
  if kept[GENERATION_FILE].get("eos_token_id") is None:
    stops = end_ids(tokenizer, eos=eos, end_of_turn=end_of_turn)
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
  return ids, generation


def _kept(tokenizer: str | os.PathLike | None) -> dict[str, dict[str, Any]]:
  """{file name: its contents} of IDS_FILE and GENERATION_FILE beside `tokenizer` ({} for
  one that is not there)."""
  directory = pathlib.Path(tokenizer).parent if tokenizer is not None else None
  return {name: _read(directory / name)
          if directory is not None and (directory / name).is_file() else {}
          for name in (IDS_FILE, GENERATION_FILE)}


def _listed(ids: int | list[int] | None) -> list[int]:
  return list(ids) if isinstance(ids, list) else [] if ids is None else [ids]


def _read(path: pathlib.Path) -> dict[str, Any]:
  return json.loads(path.read_text(encoding="utf-8"))
