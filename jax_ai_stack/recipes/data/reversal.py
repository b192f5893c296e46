"""Words to reverse, made on the fly: a string transformation whose answers a program checks.

"Reverse qnhibb" is answered "qnhibb -> bbihnq": the word, then its letters in
the opposite order. Words are 3 to 6 random lowercase letters. The same list
for every run, and any shorter list a prefix of a longer one, as
`data.arithmetic`'s. The chat source `chat_reversal` teaches the replies
(fine-tuning), the prompt source `prompts_reversal` asks the questions
(reinforcement learning, with the rewards `rl.rewards.exact_answer` and
`answer_format`); both hold out the same questions.

Example:
  >>> problems(2)[1]
  {'question': 'Reverse evq', 'answer': 'qve', 'reply': 'evq -> qve', 'pattern': '[a-z]+ -> [a-z]+'}
"""

from __future__ import annotations

import numpy as np

PATTERN = r"[a-z]+ -> [a-z]+"
"""A well-formed reply, in full (`rl.rewards.answer_format`)."""
DEFAULT_COUNT = 5000
"""Problems made when `data.max_documents` does not say."""
SHORTEST, LONGEST = 3, 6


def problems(count: int) -> list[dict[str, str]]:
  """The first `count` problems: {"question", "answer", "reply", "pattern"} each."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(count):  # Each problem draws its length, then its letters.
    size = int(rng.integers(SHORTEST, LONGEST + 1))
    word = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, size))
    out.append({"question": f"Reverse {word}", "answer": word[::-1],
                "reply": f"{word} -> {word[::-1]}", "pattern": PATTERN})
  return out
