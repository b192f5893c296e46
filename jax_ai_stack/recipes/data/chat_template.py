"""Chat templates: a conversation rendered as the model reads it, with the assistant's spans.

A model's chat template is a Jinja program shipped with its tokenizer
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`). It is
rendered here as transformers renders it: Jinja2's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter that keeps
non-ASCII text, `raise_exception` and `strftime_now`, the variables
`messages`, `add_generation_prompt`, `bos_token` and `eos_token`; the
`{% generation %}` markers some templates carry render their body unchanged.
The byte-level presets, whose tokenizer ships no template, use `BYTE_TEMPLATE`.

Which characters are the assistant's: for each assistant turn i, the text the
conversation up to turn i renders with the generation prompt is a prefix of
the text that turn i adds; what turn i adds after that prefix (its content,
its end-of-turn token and what the template writes before the next turn) is
the assistant's span, the text a model generating that turn produces. A
template that does not render a conversation's turns as prefixes of the whole
(one that rewrites earlier turns) is refused, naming the turn.

Example: the built-in template on one exchange.
  >>> template = ChatTemplate(BYTE_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")
  >>> messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
  >>> template.render(messages)
  '<|bos|><|user|>\\nhi\\n<|assistant|>\\nhello<|eos|>\\n'
  >>> template.pieces(messages)
  [('<|bos|><|user|>\\nhi\\n<|assistant|>\\n', False), ('hello<|eos|>\\n', True)]
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib

from jax_ai_stack.errors import DataError

BYTE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The template of the byte-level presets: `<|role|>` headers, each assistant turn ended by
the tokenizer's EOS, which generation stops at."""


class ChatTemplate:
  """A compiled chat template and the special tokens it is rendered with.

  Args:
    source: the Jinja text.
    bos_token, eos_token: the strings the template's `bos_token` and `eos_token` are.
    origin: where the template came from, for error messages.
  """

  def __init__(self, source: str, *, bos_token: str, eos_token: str,
               origin: str = "the chat template"):
    import jinja2  # pylint: disable=g-import-not-at-top

    self.source, self.origin = source, origin
    self.bos_token, self.eos_token = bos_token, eos_token
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateError as e:
      line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
      raise DataError(f"{origin}{line}: not a Jinja template: {e.message}") from None

  def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
             tools: list[dict] | None = None) -> str:
    """The conversation's text as the model reads it (with the functions it may call, in
    OpenAI's shape, where `tools` are given: the template's `tools` variable).

    Raises DataError naming the template when it fails (its `raise_exception`, a bad
    expression).
    """
    try:
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token,
                                   tools=tools)
    except Exception as e:  # The template runs arbitrary (sandboxed) Jinja: any error.
      raise DataError(f"{self.origin} failed to render: {e}") from None

  def pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered text cut into (text, is the assistant's) pieces, in order."""
    full = self.render(messages)
    pieces, done = [], 0
    for turn, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      prompt = self.render(messages[:turn], add_generation_prompt=True)
      through = self.render(messages[:turn + 1])
      if not (full.startswith(through) and through.startswith(prompt) and len(prompt) >= done):
        raise DataError(
            f"{self.origin} does not render message {turn} (assistant) as a continuation of "
            "the turns before it: the assistant's tokens cannot be told apart; use a template "
            "that keeps earlier turns as they are (data.chat_template)")
      pieces += [(full[done:len(prompt)], False), (full[len(prompt):len(through)], True)]
      done = len(through)
    pieces.append((full[done:], False))
    return [(text, mine) for text, mine in pieces if text]


@functools.cache
def _environment():
  """Jinja2's sandbox set up as transformers sets it up for chat templates."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.Scope(body, lineno=lineno)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  environment = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return environment


def template_source(tokenizer_path: str | None, chat_template: str | None) -> tuple[str, str]:
  """(Jinja text, where it came from) of a run's chat template.

  `chat_template`: a .jinja file of one's own; None: the tokenizer's own, from
  `chat_template.jinja` or `tokenizer_config.json` beside `tokenizer_path`, else
  `BYTE_TEMPLATE` for a run without a tokenizer file.

  Raises DataError when the file named is missing, or the tokenizer's directory holds
  no template.
  """
  if chat_template is not None:
    path = pathlib.Path(chat_template)
    if not path.is_file():
      raise DataError(f"data.chat_template={chat_template!r}: no such file")
    return path.read_text(encoding="utf-8"), f"data.chat_template={chat_template!r}"
  if tokenizer_path is None:
    return BYTE_TEMPLATE, "the built-in chat template"
  directory = pathlib.Path(tokenizer_path).parent
  jinja = directory / "chat_template.jinja"
  if jinja.is_file():
    return jinja.read_text(encoding="utf-8"), str(jinja)
  config_file = directory / "tokenizer_config.json"
  if config_file.is_file():
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # Named templates: the default one.
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
      return template, f"{config_file}'s chat_template"
  raise DataError(f"no chat template beside data.tokenizer_path={tokenizer_path!r} (neither "
                  "chat_template.jinja nor a chat_template in tokenizer_config.json): name a "
                  ".jinja file in data.chat_template")


def for_data(config, tokenizer) -> ChatTemplate:
  """The chat template of a `DataConfig` (`template_source`), with `tokenizer`'s BOS and EOS."""
  source, origin = template_source(
      config.tokenizer_path if config.tokenizer != "byte" else None, config.chat_template)
  return ChatTemplate(source, bos_token=tokenizer.token_text(tokenizer.bos_id),
                      eos_token=tokenizer.token_text(tokenizer.eos_id), origin=origin)
