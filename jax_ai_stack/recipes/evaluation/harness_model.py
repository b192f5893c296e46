"""A run's own model behind lm-evaluation-harness's model interface (`TemplateLM`).

The harness asks three things of a model. `loglikelihood`: how likely is a
continuation after a context (multiple-choice tasks pick the likeliest choice), and
would greedy decoding have produced it. `loglikelihood_rolling`: the log-likelihood
of a whole document, in windows of the context (perplexity tasks). `generate_until`:
a greedy or sampled continuation cut at the task's stop strings.

Scoring runs the model as training does (the same forward pass and the same log-softmax
of the targets as `head.target_logps`) on rows of requests sorted longest first. Packed
(the default off CPU), requests fill rows as wide as the longest, each its own segment
with its own positions, as training packs documents, so few positions are padding. On
CPU a segment mask makes the attention about 3.5x slower (measured at 512 positions:
every key block is masked, where a plain causal mask lets the blocked kernel skip or
leave most of them as they are), so there each row holds one request, with no segment
ids: sorted, a batch's rows are about as long. A batch is as wide as its longest row
rounded up to a step of a half octave (`row_width`), so a few compiled programs serve
every call.

Requests that share a context (a multiple-choice question's choices) compute it once
(`share_contexts`, the default where the model's `decode` computes what its `__call__`
does): the context's whole pages of `SHARED_PAGE` positions are prefilled once, one
question a row, into a KV cache, and each choice's remaining tokens are a chunk of its own
that reads those pages, through the model's paged decode as the generation engine runs it
(`kernels.paged`). The same scores within float rounding (1e-5 in the tests, every
family), 2.0-2.4x the requests per second of one per row on CPU and 1.9-2.2x the
harness's `hf` backend (`benchmarks/harness.py`). Generation goes through the generation engine.

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
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from jax_ai_stack.recipes import inference
from jax_ai_stack.recipes import progress as progress_lib
from jax_ai_stack.recipes.evaluation.rows import (SHARED_PAGE, Packed, group_batches, pack,
                                                  row_width, shared_contexts, shared_length,
                                                  whole_pages)
from jax_ai_stack.recipes.models.layers import KVCache

__all__ = ["HarnessModel", "decodes_as_it_scores", "for_run", "generation_seed", "pack",
           "packs_by_default", "row_width", "shared_contexts", "shared_length"]

class HarnessModel(TemplateLM):
  """lm-evaluation-harness's model interface on a decoder (see the module)."""

  def __init__(self, model: nnx.Module, tokenizer, *, batch_size: int = 8,
               max_len: int | None = None, generation_model: nnx.Module | None = None,
               chat: Callable[[list[dict], bool], str] | None = None,
               chat_template_source: str = "", packed: bool | None = None,
               share_contexts: bool | None = None, seed: int = 0):
    """`model` scores (as the run evaluates: LoRA adapters and fake quantization in its
    `__call__`); `generation_model` decodes (default `model`; a LoRA run's merged model).
    `chat(messages, add_generation_prompt)` renders a conversation with the run's chat
    template, for tasks run with `apply_chat_template`. `packed`: several requests to
    a row, each its own segment; False: one request per row; None: packed unless JAX's
    default backend is the CPU (see the module). `share_contexts`: requests with the same
    context (a multiple-choice question's choices) compute its keys and values once; None:
    wherever `model.decode` computes what its `__call__` does (not under Qwix's LoRA or
    fake quantization, which intercept `__call__` alone). `seed`: the run's; a sampled
    generation is seeded by it (or its request's own) and its place in the call
    (`generation_seed`)."""
    super().__init__()
    self.seed = seed
    self._model, self.tokenizer_ = model, tokenizer
    self._generation_model = generation_model or model
    self.batch_size_ = batch_size
    self.max_length = max_len or model.config.max_seq_len
    self._chat, self._chat_source = chat, chat_template_source
    self._packed = packs_by_default() if packed is None else packed
    shareable = decodes_as_it_scores(model)
    if share_contexts and not shareable:
      raise ValueError(f"share_contexts=True: {type(model).__name__}.decode does not compute "
                       "what its __call__ does (Qwix intercepts __call__ alone)")
    self._share = shareable if share_contexts is None else share_contexts
    self._vocab = model.config.vocab_size
    graphdef, self._state = nnx.split(model)
    self._score = functools.partial(_score, graphdef)
    self._score_shared = functools.partial(_score_shared, graphdef)

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
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    groups = shared_contexts(sequences, counts) if self._share else []
    rest = sorted(set(range(len(requests))) - {i for group in groups for i in group})
    with progress_lib.bar("scoring", unit="request", total=len(requests), tenths=True,
                          disable=disable_tqdm) as progress:
      for batch in group_batches(groups, self.batch_size_):
        self._score_contexts_once(batch, sequences, counts, results)
        progress.update(sum(map(len, batch)))
      for batch in self._rows(rest, sequences):
        self._score_rows(batch, sequences, counts, results)
        progress.update(sum(map(len, batch)))
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def _rows(self, indices: list[int], sequences: list[list[int]]) -> Iterator[list[list[int]]]:
    """Batches of rows (each a list of requests) of `indices`, packed or one per row."""
    if not indices:
      return
    width = row_width(max(len(sequences[i]) - 1 for i in indices), self.max_length)
    rows = pack([len(sequences[i]) - 1 for i in indices], width if self._packed else 0)
    rows = [[indices[i] for i in row] for row in rows]
    for start in range(0, len(rows), self.batch_size_):
      yield rows[start:start + self.batch_size_]

  def _score_rows(self, batch_rows, sequences, counts, results) -> None:
    """One forward pass over a batch of rows (`_rows`), as training runs the model."""
    longest = max(sum(len(sequences[i]) - 1 for i in row) for row in batch_rows)
    batch = Packed(self.batch_size_, row_width(longest, self.max_length))
    places = [(row, batch.add(row, sequences[index]), index)
              for row, members in enumerate(batch_rows) for index in members]
    inputs, targets, segment_ids, positions = batch.arrays()
    if all(len(members) == 1 for members in batch_rows):
      segment_ids = positions = None  # Causal alone: a row's padding follows its request.
    logps, greedy = (np.asarray(x) for x in self._score(self._state, inputs, targets,
                                                        segment_ids, positions))
    for row, end, index in places:
      results[index] = _result(logps[row], greedy[row], end, counts[index])

  def _score_contexts_once(self, groups, sequences, counts, results) -> None:
    """Requests that share a context (`shared_contexts`): the contexts' whole pages are
    prefilled once, one group a row, and each request's remaining tokens read them as a
    chunk of its own (the model's paged decode, as the engine runs it)."""
    page = SHARED_PAGE
    prefix_lengths = [shared_length(sequences[g[0]], counts[g[0]]) for g in groups]
    prefix_width = whole_pages(row_width(max(prefix_lengths), self.max_length))
    prefixes = np.zeros((self.batch_size_, prefix_width), np.int32)
    for row, (group, length) in enumerate(zip(groups, prefix_lengths)):
      prefixes[row, :length] = sequences[group[0]][:length]
    members = [(row, index) for row, group in enumerate(groups) for index in group]
    rest_width = whole_pages(row_width(
        max(len(sequences[i]) - 1 - prefix_lengths[row] for row, i in members), self.max_length))
    rows = row_width(len(members), len(members) * 2, least=self.batch_size_)
    inputs, targets = np.zeros((2, rows, rest_width), np.int32)
    starts = np.zeros(rows, np.int32)
    table = np.zeros((rows, (prefix_width + rest_width) // page), np.int32)
    first_rest_page = 1 + self.batch_size_ * prefix_width // page  # Page 0: the unused page.
    for member, (row, index) in enumerate(members):
      start, sequence = prefix_lengths[row], sequences[index]
      rest = len(sequence) - 1 - start
      inputs[member, :rest] = sequence[start:-1]
      targets[member, :rest] = sequence[start + 1:]
      starts[member] = start
      table[member, :start // page] = 1 + row * prefix_width // page + np.arange(start // page)
      table[member, start // page:(start + rest_width) // page] = (
          first_rest_page + member * rest_width // page + np.arange(rest_width // page))
    logps, greedy = (np.asarray(x) for x in self._score_shared(
        self._state, prefixes, inputs, targets, starts, table))
    for member, (row, index) in enumerate(members):
      end = len(sequences[index]) - 1 - prefix_lengths[row]
      results[index] = _result(logps[member], greedy[member], end, counts[index])

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
    `max_gen_toks`, all through one generation engine; the text ends before the stop.
    The harness repeats a request `repeats` times in `requests` (self-consistency, pass@k):
    each is seeded by its place, so the repeats are samples of their own."""
    slots = min(len(requests), self.batch_size_) or 1
    engine = inference.Engine(self._generation_model, max_slots=slots, max_len=self.max_length,
                              decode=self.tok_decode)
    asked = [self._request(*request.args, position=position)
             for position, request in enumerate(requests)]
    outputs = [""] * len(requests)
    with progress_lib.bar("generating", unit="request", total=len(requests), tenths=True,
                          disable=disable_tqdm) as progress:
      for completion in engine.stream(asked):
        outputs[completion.index] = completion.text
        progress.update(1)
    for request, output in zip(requests, outputs):
      self.cache_hook.add_partial("generate_until", request.args, output)
    return outputs

  def _request(self, context: str, settings: dict, position: int = 0) -> inference.Request:
    """The engine's request for a harness context, the `position`-th of its call: its oldest
    tokens dropped to leave room for `max_gen_toks`."""
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
        top_k=int(top_k) if top_k else None,
        seed=generation_seed(settings.get("seed"), self.seed, position),
        stop_ids=(self.eot_token_id,) if self.eot_token_id < self._vocab else (),
        stop=tuple(_stops(settings, self.tok_decode, self.eot_token_id)))


def generation_seed(asked: int | None, run_seed: int, position: int) -> int:
  """The engine seed of the `position`-th generation of a call: drawn from the request's
  own seed (`asked`; None: the run's) and the position, so that the harness's repeats of
  one request differ and a run gives the same samples again.

  Example:
    >>> [generation_seed(None, 0, p) == generation_seed(None, 0, 0) for p in (0, 1)]
    [True, False]
  """
  base = run_seed if asked is None else int(asked)
  return int(np.random.SeedSequence([base % 2**32, position]).generate_state(1)[0] >> 1)


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
      chat_template_source=template.source, seed=run.config.train.seed)


def packs_by_default() -> bool:
  """Whether `HarnessModel` packs requests when not told: not on CPU (see the module)."""
  return jax.default_backend() != "cpu"


def decodes_as_it_scores(model: nnx.Module) -> bool:
  """Whether `model.decode` runs what `model(...)` does: both from the same class, not a
  `__call__` that Qwix put in front (LoRA adapters, fake quantization)."""
  owner = lambda name: next((c for c in type(model).__mro__ if name in vars(c)), None)
  return owner("__call__") is owner("decode")


def _result(logps: np.ndarray, greedy: np.ndarray, end: int, count: int) -> tuple[float, bool]:
  """(log-likelihood, is greedy) of the `count` targets of a row that end before `end`."""
  scored = slice(end - count, end)
  return float(logps[scored].sum()), bool(greedy[scored].all())


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, inputs, targets, segment_ids, positions):
  """log p(targets) and whether each is the likeliest token, [B, T] each."""
  logits = nnx.merge(graphdef, state)(inputs, segment_ids=segment_ids, positions=positions)
  return _target_scores(logits, targets)


@functools.partial(jax.jit, static_argnums=0)
def _score_shared(graphdef, state, prefixes, inputs, targets, starts, block_table):
  """`_score` of inputs [R, T] that follow shared prefixes [G, S] (row r at position
  starts[r], its pages `block_table` [R, W]: page 0 unused, then the prefixes' pages, then
  the rows' own)."""
  model = nnx.merge(graphdef, state)
  _, cache = model.decode(prefixes, model.init_cache(*prefixes.shape))
  own = inputs.shape[0] * inputs.shape[1] // SHARED_PAGE

  def pool(prefilled):  # [..., G, S, K, H] -> [..., K, 1 + G * S / page + own, page, H]
    *lead, g, s, k, h = prefilled.shape
    pages = jnp.moveaxis(prefilled.reshape(*lead, g * s // SHARED_PAGE, SHARED_PAGE, k, h), -2,
                         -4)
    empty = lambda count: jnp.zeros((*lead, k, count, SHARED_PAGE, h), prefilled.dtype)
    return jnp.concatenate([empty(1), pages, empty(own)], axis=-3)

  # The contiguous keys and values cut into the pages `cache_specs()` lays out.
  logits, _ = model.decode(inputs, KVCache(jax.tree.map(pool, cache.state), starts,
                                           block_table))
  return _target_scores(logits, targets)


def _target_scores(logits, targets):
  logps = -optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return logps, jnp.argmax(logits, axis=-1) == targets
