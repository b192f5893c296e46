"""The tokenizer's special-token ids of a Hugging Face directory, carried through a run unchanged.

config.json's `bos_token_id`, `eos_token_id` and `pad_token_id` (a list where the
file has one, None where it says null) and generation_config.json are the
tokenizer's, not the model's: `import-hf` keeps them beside the copied
tokenizer.json (`keep`), and `export-hf` writes them back as they came
(`for_export`), with generation_config.json's `eos_token_id` holding every
end-of-turn token that `generate --chat` stops at, so that transformers'
`generate` on the export stops where ours does. A run whose tokenizer came
without them (a tokenizer.json alone) exports the ids the tokenizer found.

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


def for_export(tokenizer: str | os.PathLike, *, bos: int, eos: int, pad: int,
               end_of_turn: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(config.json's token ids, generation_config.json) for a run whose tokenizer is the file
  `tokenizer`: what was kept beside it, else the ids the tokenizer found (`bos`, ...);
  generation_config's `eos_token_id` then gains the `end_of_turn` ids it lacks."""
  directory = pathlib.Path(tokenizer).parent
  kept = directory / IDS_FILE
  ids = (_read(kept) if kept.is_file()
         else {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
  generation = (_read(directory / GENERATION_FILE) if (directory / GENERATION_FILE).is_file()
                else {key: value for key, value in ids.items() if value is not None})
  stops = generation.get("eos_token_id", ids.get("eos_token_id"))
  stops = list(stops) if isinstance(stops, list) else [] if stops is None else [stops]
  stops += [i for i in end_of_turn if i not in stops]
  generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
  return ids, generation


def _read(path: pathlib.Path) -> dict[str, Any]:
  return json.loads(path.read_text(encoding="utf-8"))
