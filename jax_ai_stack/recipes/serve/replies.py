"""OpenAI's reply objects, whole or as streamed chunks, built from a request's updates.

Each choice of a request (`Choice`) gathers the text, tokens and finish reason its
engine job's updates bring; `Reply` turns them into `text_completion` /
`chat.completion` objects or their chunks, with log-probs where asked. A chat that reads
tool calls (`tools.ToolSyntax`) sends its calls as `tool_calls` (finish reason
"tool_calls"); streamed, its text is held back from a call's opening on, and the calls
come in the last chunk.

Example: a completion's one choice after its one update.
  >>> import types
  >>> from jax_ai_stack.recipes.serve import worker
  >>> ask = openai_api.parse_completion({"model": "m", "prompt": "Hi"}, max_top_logprobs=0)
  >>> reply = Reply(ask, types.SimpleNamespace(name="m"), chat=False, prompt_tokens=2)
  >>> choice = Choice(0, job=None)
  >>> reply.take(choice, worker.Update([5, 6], [-1.0, -2.0], [], "length", "ab"))
  ('ab', None, 'length')
  >>> whole = reply.whole([choice], {0: []})
  >>> whole["choices"][0]["text"], whole["usage"]["total_tokens"]
  ('ab', 4)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from jax_ai_stack.recipes.serve import openai_api, tools as tools_lib
from jax_ai_stack.recipes.serve.worker import Job, Update

__all__ = ["Choice", "Reply", "joined"]


@dataclasses.dataclass
class Choice:
  """One choice of a request: its engine job and the text sent so far."""

  index: int
  job: Job
  text: str = ""
  tokens: int = 0
  finish_reason: str = ""
  sent: int = 0  # With tools: the characters of its reply sent as content so far.
  calls: list[dict] = dataclasses.field(default_factory=list)  # With tools: once finished,
  content: str | None = None  # and the text outside them (None: none).


class Reply:
  """Turns updates into OpenAI's reply objects, whole or as chunks."""

  def __init__(self, ask: openai_api.Ask, served, chat: bool, prompt_tokens: int, *,
               tools: tools_lib.ToolSyntax | None = None, reply_start: str = ""):
    """`served`: the server's `Served` (its model's name, its tokenizer). `tools`: how a
    chat's calls are written, where they are read; `reply_start`: what the prompt made
    the reply begin with (`ToolSyntax.reply_start`)."""
    self.ask, self.served, self.chat, self.prompt_tokens = ask, served, chat, prompt_tokens
    self.tools, self.reply_start = tools, reply_start
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())

  def take(self, choice: Choice, update: Update
           ) -> tuple[str, dict | None, str]:
    """The new text of `choice` after `update`, its log-probs part, and its finish reason
    ("" while it runs)."""
    before = len(choice.text)
    choice.text += update.text
    choice.tokens += len(update.tokens)
    choice.finish_reason = update.finish_reason
    if self.tools is None:
      return update.text, self._logprobs(update, before), choice.finish_reason
    reply = self.reply_start + choice.text
    if not choice.finish_reason:
      upto = max(choice.sent, self.tools.held_back(reply))
    else:
      choice.content, choice.calls = self.tools.read(reply)
      if choice.calls:
        reply = choice.content or ""
      upto = len(reply)
      choice.finish_reason = "tool_calls" if choice.calls else choice.finish_reason
    text, choice.sent = reply[choice.sent:upto], upto
    return text, self._logprobs(update, before), choice.finish_reason

  def _logprobs(self, update: Update, offset: int) -> dict | None:
    if not self.ask.logprobs:
      return None
    token_text = lambda token: self.served.tokenizer.decode([token])
    texts = [token_text(t) for t in update.tokens]
    top = [[(token_text(t), v) for t, v in row] for row in update.top_logprobs]
    if self.chat:
      return openai_api.chat_logprobs(texts, update.logprobs, top)
    return openai_api.completion_logprobs(texts, update.logprobs, top, offset)

  def whole(self, choices: Sequence[Choice], parts: dict[int, list[dict]]) -> dict:
    """The non-streamed reply, `parts` each choice's log-probs parts in order."""
    out = []
    for choice in choices:
      logprobs = joined(parts[choice.index], self.chat) if self.ask.logprobs else None
      if self.chat:
        message = {"role": "assistant", "content": self.reply_start + choice.text}
        if choice.calls:
          message.update(content=choice.content, tool_calls=choice.calls)
        out.append({"index": choice.index, "finish_reason": choice.finish_reason,
                    "message": message, "logprobs": logprobs})
      else:
        out.append({"index": choice.index, "finish_reason": choice.finish_reason,
                    "text": choice.text, "logprobs": logprobs})
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.served.name, "choices": out,
            "usage": self._usage(choices)}

  def chunk(self, choice: Choice, text: str, logprobs: dict | None, finish: str,
            first: bool) -> dict:
    """One streamed chunk for `choice`."""
    if self.chat:
      delta = {"role": "assistant", "content": text} if first else {"content": text}
      if finish and choice.calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice.calls)]
      entry = {"index": choice.index, "delta": delta, "logprobs": logprobs,
               "finish_reason": finish or None}
    else:
      entry = {"index": choice.index, "text": text, "logprobs": logprobs,
               "finish_reason": finish or None}
    return self._chunk([entry])

  def usage_chunk(self, choices: Sequence[Choice]) -> dict:
    return {**self._chunk([]), "usage": self._usage(choices)}

  def _chunk(self, entries: list[dict]) -> dict:
    return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.served.name, "choices": entries}

  def _usage(self, choices: Sequence[Choice]) -> dict:
    return openai_api.usage(self.prompt_tokens, sum(choice.tokens for choice in choices))


def joined(parts: list[dict], chat: bool) -> dict:
  """Log-probs parts of one choice as one object."""
  if chat:
    return {"content": [entry for part in parts for entry in part["content"]]}
  joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for part in parts:
    for key in joined:
      joined[key] += part[key] or []
  return joined
