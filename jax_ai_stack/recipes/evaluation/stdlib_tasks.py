"""Harness tasks made from the Python standard library itself, so `eval --tasks` runs
offline on a fresh machine (`--tasks stdlib` runs all four).

They ask about the documented public functions the `chat_stdlib` source asks about
(`data.chat.stdlib_functions`), in its words:

  stdlib_docstrings           multiple choice: "What does `json.dumps(obj, ...)` do?",
                              and four docstring summaries, the function's own and
                              three others (chance 0.25; `acc_norm` divides each
                              choice's log-likelihood by its length)
  stdlib_docstrings_held_out  the same, on the functions `chat_stdlib` holds out at
                              `HELD_OUT_FRACTION` (lm-tiny-sft's validation_fraction)
  stdlib_calls                generate until "(": "Which function: Serialize obj to a
                              JSON formatted str." answered "`json.dumps" (exact match)
  stdlib_definitions          multiple choice: a function's `def` line, and three
                              copies with two neighbouring characters swapped (chance
                              0.25): what a model has learned of Python itself

`stdlib_docstrings` and `stdlib_calls` measure what a model has learned of the
standard library (`lm-tiny-sft` trains on their questions); the held-out one,
whether it carries over to functions it never saw.

`write(directory)` writes each task as an ordinary harness task file beside its
JSONL data (the data's path written into the YAML), for a user to read, copy and
change. The standard library differs between Python versions, and so do the
tasks: each file names the Python that made it.

Example:
  >>> import pathlib, tempfile
  >>> written = write(pathlib.Path(tempfile.mkdtemp()))
  >>> sorted(p.stem for p in written.glob("*.yaml")) == sorted(TASKS)
  True
"""

from __future__ import annotations

import json
import pathlib
import platform

import numpy as np

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.recipes.data import chat

NAME = "stdlib"
"""What `--tasks` calls all of them."""
TASKS = ("stdlib_docstrings", "stdlib_docstrings_held_out", "stdlib_calls",
         "stdlib_definitions")
HELD_OUT_FRACTION = 0.1
"""The functions `chat_stdlib` holds out at this `data.validation_fraction` (lm-tiny-sft's)."""
CHOICES = 4

_HEADER = """# Made by jax_ai_stack.recipes.evaluation.stdlib_tasks from Python {python}'s standard
# library: {which}.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
_DOCSTRINGS = """output_type: multiple_choice
doc_to_text: "What does `{{call}}` do?"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1
"""
_DEFINITIONS = """output_type: multiple_choice
doc_to_text: "# {{summary}}"
target_delimiter: "\\n"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
metadata:
  version: 1
"""
_CALLS = """output_type: generate_until
doc_to_text: "Which function: {{summary}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["(", "\\n"]
  max_gen_toks: 40
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1
"""


def held_out(functions: list[chat.StdlibFunction]) -> list[chat.StdlibFunction]:
  """The `functions` that `chat_stdlib` holds out at `HELD_OUT_FRACTION`."""
  keep = chat.held_out_by_key([f.key for f in functions], HELD_OUT_FRACTION,
                              salt=chat.HOLDOUT_SALT)
  return [f for f, k in zip(functions, keep) if k]


def docstring_rows(functions: list[chat.StdlibFunction]) -> list[dict]:
  """A multiple-choice row per function: its summary among three others, at a place drawn
  from seed 0 (the same rows on every run)."""
  rng = np.random.default_rng(0)
  rows = []
  for function in functions:
    others = [f.summary for f in functions if f.summary != function.summary]
    picked = [others[j] for j in rng.choice(len(others), CHOICES - 1, replace=False)]
    answer = int(rng.integers(CHOICES))
    picked.insert(answer, function.summary)
    rows.append({"call": function.call, "choices": picked, "answer": answer})
  return rows


def call_rows(functions: list[chat.StdlibFunction]) -> list[dict]:
  """A generation row per function: its summary, and its name as `chat_stdlib` replies it."""
  return [{"summary": f.summary, "target": f"`{f.key}"} for f in functions]


def definition_rows(functions: list[chat.StdlibFunction]) -> list[dict]:
  """A multiple-choice row per function: its `def` line among three copies, each with two
  neighbouring characters swapped at a place drawn from seed 0 (the same rows on every
  run), under its summary as a comment."""
  rng = np.random.default_rng(0)
  rows = []
  for function in functions:
    line = f"def {function.key.rpartition('.')[2]}{function.call[len(function.key):]}:"
    broken = set()
    while len(broken) < CHOICES - 1:
      i = int(rng.integers(4, len(line) - 2))  # After "def ": the name on.
      swapped = line[:i] + line[i + 1] + line[i] + line[i + 2:]
      if swapped != line:
        broken.add(swapped)
    choices = sorted(broken)
    answer = int(rng.integers(CHOICES))
    choices.insert(answer, line)
    rows.append({"summary": function.summary, "choices": choices, "answer": answer})
  return rows


Made = list[tuple[str, list[dict], str, str]]
"""Each task's name, rows, YAML body and which functions it asks about (`make`)."""


def make() -> Made:
  """The tasks, from one walk of the standard library."""
  functions = list(chat.stdlib_functions())
  held = f"the documented functions chat_stdlib holds out at validation_fraction " \
         f"{HELD_OUT_FRACTION}"
  every = "its documented functions"
  return [("stdlib_docstrings", docstring_rows(functions), _DOCSTRINGS, every),
          ("stdlib_docstrings_held_out", docstring_rows(held_out(functions)), _DOCSTRINGS, held),
          ("stdlib_calls", call_rows(functions), _CALLS, every),
          ("stdlib_definitions", definition_rows(functions), _DEFINITIONS, every)]


def write(directory: pathlib.Path, made: Made | None = None) -> pathlib.Path:
  """Writes the tasks (`made`, else `make()`'s: YAML and JSONL each) into `directory`;
  returns it."""
  directory.mkdir(parents=True, exist_ok=True)
  for task, rows, body, which in made or make():
    data = directory.resolve() / f"{task}.jsonl"
    write_atomically(data, "".join(json.dumps(row) + "\n" for row in rows))
    header = _HEADER.format(python=platform.python_version(), which=which, task=task,
                            data=json.dumps(str(data)))
    write_atomically(directory / f"{task}.yaml", header + body)
  return directory
