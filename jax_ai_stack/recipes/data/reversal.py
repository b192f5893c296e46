"""Words to reverse, made on the fly: a string transformation whose answers a program checks.

"Reverse qnhibb" is answered "qnhibb -> bbihnq": the word, then its letters in
the opposite order. Words are 3 to 6 random lowercase letters. The same list
for every run, and any shorter list a prefix of a longer one, as
`data.arithmetic`'s. The chat source `chat_reversal` teaches the replies
(fine-tuning), the prompt source `prompts_reversal` asks the questions
(reinforcement learning, with the rewards `rl.rewards.exact_answer` and
`answer_format`); both hold out the same questions.

The teacher is careless on purpose: two replies in three (chosen by a hash of
the word, which no model can learn) stop a letter short, "evq -> qv". A model
fine-tuned on them reverses words but mostly stops early, so its greedy exact
answers stay low however long it trains and whatever the numerics; sampled
replies are whole often enough for GRPO, rewarded only for the exact `answer`
(always whole), to teach it to finish (`benchmarks/rl_demo.py`).

Example:
  >>> problems(2)[1]
  {'question': 'Reverse evq', 'answer': 'qve', 'reply': 'evq -> qv', 'pattern': '[a-z]+ -> [a-z]+'}
  >>> taught_reply("woat"), taught_reply("evq")
  ('woat -> taow', 'evq -> qv')
"""

from __future__ import annotations

import zlib

import numpy as np

PATTERN = r"[a-z]+ -> [a-z]+"
"""A well-formed reply, in full (`rl.rewards.answer_format`)."""
DEFAULT_COUNT = 5000
"""Problems made when `data.max_documents` does not say."""
SHORTEST, LONGEST = 3, 6
CAREFUL_EVERY = 3
"""One word in this many (by a hash of the word) has its reply taught whole; the others'
replies stop a letter short (see `taught_reply`)."""


def taught_reply(word: str) -> str:
  """The reply `chat_reversal` teaches for `word`: whole for one word in `CAREFUL_EVERY`, the
  others without the reversal's last letter."""
  whole = word[::-1]
  careful = zlib.crc32(word.encode()) % CAREFUL_EVERY == 0
  return f"{word} -> {whole if careful else whole[:-1]}"


def problems(count: int) -> list[dict[str, str]]:
  """The first `count` problems: {"question", "answer", "reply", "pattern"} each; "reply" is
  the one taught (`taught_reply`), "answer" the right one."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(count):  # Each problem draws its length, then its letters.
    size = int(rng.integers(SHORTEST, LONGEST + 1))
    word = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, size))
    out.append({"question": f"Reverse {word}", "answer": word[::-1],
                "reply": taught_reply(word), "pattern": PATTERN})
  return out
