"""A run's own model behind lm-evaluation-harness's model interface (`TemplateLM`).

The harness asks three things of a model. `loglikelihood`: how likely is a
continuation after a context (multiple-choice tasks pick the likeliest choice), and
would greedy decoding have produced it. `loglikelihood_rolling`: the log-likelihood
of a whole document, in windows of the context (perplexity tasks). `generate_until`:
a greedy or sampled continuation cut at the task's stop strings. Scoring runs the
model as training does (the same forward pass and the same log-softmax of the
targets as `head.target_logps`) on rows of requests sorted longest first. Packed
(the default off CPU), requests fill rows as wide as the longest, each its own
segment with its own positions, as training packs documents, so few positions are
padding. On CPU a segment mask makes the attention about 3.5x slower (measured at
512 positions: every key block is masked, where a plain causal mask lets the
blocked kernel skip or leave most of them as they are), so there each row holds
one request, with no segment ids: sorted, a batch's rows are about as long, and
scoring is about 2x faster than packed (`benchmarks/harness.py`). A batch is as wide
as its longest row rounded up to a step of a half octave (`row_width`), so a few
compiled programs serve every call. Generation goes through the generation engine.

Example: a two-token continuation scored on a tiny model.
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import data, models
  >>> model = models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> harness_model = HarnessModel(model, data.ByteTokenizer(), batch_size=4)
  >>> [(logp, greedy)] = harness_model._loglikelihood_tokens([(("a", "bc"), [97], [98, 99])],
  ...                                                         disable_tqdm=True)
  >>> logp < 0, greedy in (True, False)
  (True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from jax_ai_stack.recipes import inference

__all__ = ["HarnessModel", "for_run", "pack", "packs_by_default", "row_width"]

MIN_WIDTH = 16
"""The narrowest batch `row_width` makes (the engine's smallest padded prompt too)."""


class HarnessModel(TemplateLM):
  """lm-evaluation-harness's model interface on a decoder (see the module)."""

  def __init__(self, model: nnx.Module, tokenizer, *, batch_size: int = 8,
               max_len: int | None = None, generation_model: nnx.Module | None = None,
               chat: Callable[[list[dict], bool], str] | None = None,
               chat_template_source: str = "", packed: bool | None = None):
    """`model` scores (as the run evaluates: LoRA adapters and fake quantization in its
    `__call__`); `generation_model` decodes (default `model`; a LoRA run's merged model).
    `chat(messages, add_generation_prompt)` renders a conversation with the run's chat
    template, for tasks run with `apply_chat_template`. `packed`: several requests to
    a row, each its own segment; False: one request per row; None: packed unless JAX's
    default backend is the CPU (see the module)."""
    super().__init__()
    self._model, self.tokenizer_ = model, tokenizer
    self._generation_model = generation_model or model
    self.batch_size_ = batch_size
    self.max_length = max_len or model.config.max_seq_len
    self._chat, self._chat_source = chat, chat_template_source
    self._packed = packs_by_default() if packed is None else packed
    self._vocab = model.config.vocab_size
    graphdef, self._state = nnx.split(model)
    self._score = functools.partial(_score, graphdef)

  # The harness's questions about the tokenizer.

  @property
  def eot_token_id(self) -> int:
    return int(self.tokenizer_.eos_id)

  @property
  def prefix_token_id(self) -> int:
    """What an empty context conditions on: BOS."""
    return int(self.tokenizer_.bos_id)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 **kwargs) -> list[int]:
    """Token ids of `string`, a rendered chat template's BOS/EOS texts as their ids."""
    del add_special_tokens, kwargs
    return [int(t) for t in self.tokenizer_.encode_rendered(string)]

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer_.decode(list(tokens))

  @property
  def tokenizer_name(self) -> str:
    return f"jax-ai-stack-{type(self.tokenizer_).__name__}"

  def chat_template(self, chat_template: bool | str = False) -> str:
    return self._chat_source if chat_template else ""

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True
                          ) -> str:
    if self._chat is None:
      raise ValueError("this run has no chat template; run the task without "
                       "apply_chat_template")
    return self._chat(chat_history, add_generation_prompt)

  # Scoring.

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding gives the continuation) for
    each (key, context ids, continuation ids); a context longer than the model's window
    loses its oldest tokens."""
    del kwargs
    sequences = [(list(context) + list(continuation))[-(self.max_length + 1):]
                 for _, context, continuation in requests]
    counts = [len(continuation) for _, _, continuation in requests]
    lengths = [len(s) - 1 for s in sequences]
    width = row_width(max(lengths), self.max_length)
    rows = pack(lengths, width if self._packed else 0)
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in tqdm(range(0, len(rows), self.batch_size_), desc="scoring",
                      disable=disable_tqdm):
      batch_rows = rows[start:start + self.batch_size_]
      longest = max(sum(lengths[i] for i in row) for row in batch_rows)
      batch = _Packed(self.batch_size_, row_width(longest, width))
      places = [(row, batch.add(row, sequences[index]), index)
                for row, members in enumerate(batch_rows) for index in members]
      inputs, targets, segment_ids, positions = batch.arrays()
      if all(len(members) == 1 for members in batch_rows):
        segment_ids = positions = None  # Causal alone: a row's padding follows its request.
      logps, greedy = (np.asarray(x) for x in self._score(self._state, inputs, targets,
                                                          segment_ids, positions))
      for row, end, index in places:
        scored = slice(end - counts[index], end)
        results[index] = (float(logps[row, scored].sum()), bool(greedy[row, scored].all()))
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each document's log-likelihood: its tokens in disjoint windows of the model's
    context, each window conditioned on the tokens before it (the harness's rule)."""
    windows, owners = [], []
    for number, request in enumerate(requests):
      (text,) = request.args
      for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                       lm_eval_utils.get_rolling_token_windows(
                                           self.tok_encode(text), self.prefix_token_id,
                                           self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owners.append(number)
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals = [0.0] * len(requests)
    for owner, (logp, _) in zip(owners, scores):
      totals[owner] += logp
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  # Generation.

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each context continued (greedy unless `do_sample`) until a stop string, EOS or
    `max_gen_toks`, all through one generation engine; the text ends before the stop."""
    slots = min(len(requests), self.batch_size_) or 1
    engine = inference.Engine(self._generation_model, max_slots=slots, max_len=self.max_length,
                              decode=self.tok_decode)
    asked = [self._request(*request.args) for request in requests]
    outputs = [""] * len(requests)
    with tqdm(total=len(requests), desc="generating", disable=disable_tqdm) as progress:
      for completion in engine.stream(asked):
        outputs[completion.index] = completion.text
        progress.update(1)
    for request, output in zip(requests, outputs):
      self.cache_hook.add_partial("generate_until", request.args, output)
    return outputs

  def _request(self, context: str, settings: dict) -> inference.Request:
    """The engine's request for a harness context: its oldest tokens dropped to leave
    room for `max_gen_toks`."""
    settings = dict(settings)
    max_tokens = int(settings.pop("max_gen_toks", 256))
    max_tokens = max(1, min(max_tokens, self.max_length - 1))
    prompt = self.tok_encode(context)[-(self.max_length - max_tokens):] or [self.prefix_token_id]
    sample = bool(settings.get("do_sample", False))
    temperature = float(settings.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0
    top_p, top_k = settings.get("top_p"), settings.get("top_k")
    return inference.Request(
        tuple(prompt), max_tokens, temperature=temperature,
        top_p=float(top_p) if top_p and top_p < 1 else None,
        top_k=int(top_k) if top_k else None, seed=int(settings.get("seed", 0) or 0),
        stop_ids=(self.eot_token_id,) if self.eot_token_id < self._vocab else (),
        stop=tuple(_stops(settings, self.tok_decode, self.eot_token_id)))


def _stops(settings: dict, decode: Callable, eot: int) -> list[str]:
  """The harness's `until` strings (one string or a list); its default is the EOS text."""
  until = settings.get("until", [decode([eot])])
  return [s for s in ([until] if isinstance(until, str) else until) if s]


def for_run(run, *, batch_size: int, scoring: nnx.Module | None = None,
            generating: nnx.Module | None = None) -> HarnessModel:
  """The HarnessModel of a run (a `Run`): its model scores, its inference model generates
  (or the given copies of them), its tokenizer, and its chat template (`data.chat_template`,
  the tokenizer's own, or the built-in one, as `generate --chat` renders it)."""
  from jax_ai_stack.recipes import data  # pylint: disable=g-import-not-at-top

  tokenizer = run.task.tokenizer()
  template = data.chat_template.for_data(run.config.data, tokenizer)
  return HarnessModel(
      run.model if scoring is None else scoring, tokenizer, batch_size=batch_size,
      generation_model=run.inference_model() if generating is None else generating,
      chat=lambda messages, prompt: template.render(messages, add_generation_prompt=prompt),
      chat_template_source=template.source)


def packs_by_default() -> bool:
  """Whether `HarnessModel` packs requests when not told: not on CPU (see the module)."""
  return jax.default_backend() != "cpu"


def row_width(size: int, limit: int) -> int:
  """`size` positions rounded up to 16, 24, 32, 48, 64, 96, ... (two steps an octave, at
  most a third of padding), at most `limit`: few compiled programs, little padding.

  Example:
    >>> [row_width(n, 512) for n in (5, 17, 25, 90, 100, 400, 600)]
    [16, 24, 32, 96, 128, 512, 512]
  """
  octave = 1 << (max(size, 1) - 1).bit_length()
  step = octave * 3 // 4 if size <= octave * 3 // 4 else octave
  return min(max(MIN_WIDTH, step), limit)


def pack(lengths: Sequence[int], width: int) -> list[list[int]]:
  """Rows of at most `width` positions holding sequences of `lengths`: first fit, longest
  first; each row lists its sequences' indices (a width below a length: one per row)."""
  rows: list[list[int]] = []
  room: list[int] = []
  for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
    if row == len(rows):
      rows.append([])
      room.append(width)
    rows[row].append(index)
    room[row] -= lengths[index]
  return rows


class _Packed:
  """One batch of packed rows being filled: inputs, targets, segment ids and positions."""

  def __init__(self, batch_size: int, width: int):
    self.inputs = np.zeros((batch_size, width), np.int32)
    self.targets = np.zeros_like(self.inputs)
    self.segment_ids = np.zeros_like(self.inputs)
    self.positions = np.zeros_like(self.inputs)
    self._used = [0] * batch_size

  def add(self, row: int, sequence: list[int]) -> int:
    """Puts `sequence` (inputs its tokens but the last, targets but the first) in `row` as
    its next segment; the position after its last."""
    first = self._used[row]
    end = first + len(sequence) - 1
    self.inputs[row, first:end], self.targets[row, first:end] = sequence[:-1], sequence[1:]
    self.segment_ids[row, first:end] = self.segment_ids[row, :first].max(initial=0) + 1
    self.positions[row, first:end] = np.arange(end - first)
    self._used[row] = end
    return end

  def arrays(self) -> tuple[np.ndarray, ...]:
    return self.inputs, self.targets, self.segment_ids, self.positions


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, inputs, targets, segment_ids, positions):
  """log p(targets) and whether each is the likeliest token, [B, T] each."""
  logits = nnx.merge(graphdef, state)(inputs, segment_ids=segment_ids, positions=positions)
  logps = -optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return logps, jnp.argmax(logits, axis=-1) == targets
