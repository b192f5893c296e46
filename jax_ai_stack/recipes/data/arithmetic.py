"""Arithmetic problems made on the fly: a task whose answers a program checks, offline.

Sums and differences of two numbers below 100, "What is 85 - 63?", with the
answer ("22") and the reply a model is taught to give ("85 - 63 = 22"). The
same list for every run, and any shorter list a prefix of a longer one. The
chat source `chat_arithmetic` teaches the replies (fine-tuning), the prompt
source `prompts_arithmetic` asks the questions (reinforcement learning, with
the rewards `rl.rewards.exact_answer` and `answer_format`); both hold out the
same questions (`key`).

Example:
  >>> problems(2)[1]["reply"], problems(2)[1]["answer"]
  ('26 + 30 = 56', '56')
"""

from __future__ import annotations

import numpy as np

PATTERN = r"\d+ [+-] \d+ = -?\d+"
"""A well-formed reply, in full (`rl.rewards.answer_format`)."""
LIMIT = 100
"""Operands are in [0, LIMIT)."""
DEFAULT_COUNT = 5000
"""Problems made when `data.max_documents` does not say."""


def problems(count: int) -> list[dict[str, str]]:
  """The first `count` problems: {"question", "answer", "reply", "pattern"} each."""
  rng = np.random.default_rng(0)
  out = []
  for a, b, c in rng.integers(0, LIMIT, (count, 3)).tolist():  # Row i: draws 3i..3i+2.
    op, value = ("-", a - b) if c % 2 else ("+", a + b)
    out.append({"question": f"What is {a} {op} {b}?", "answer": str(value),
                "reply": f"{a} {op} {b} = {value}", "pattern": PATTERN})
  return out
