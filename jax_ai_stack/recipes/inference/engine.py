"""The generation engine: many requests at once, each with its own prompt, settings and end.

`Engine(model).run(requests)` decodes a list of `Request`s in one batch of
`max_slots` rows and returns a `Completion` for each; `stream` yields each as
it finishes. A server drives it a step at a time: `add` queues a request at
any moment, `step` admits and decodes `steps_per_call` tokens for every running
request (returning the completions that grew), `cancel` frees the slot of a
request whose client went away. A request is admitted to a free slot (of `max_slots`,
each with up to `max_len` positions) when the KV cache has its pages; its prompt is
prefilled into them in a row of its own, `prefill_chunk` tokens per step, between the
decoding calls of the running requests, so that a long prompt does not stall them; then
one compiled call decodes `steps_per_call` tokens for every slot past its prompt (a loop
on the device, each token fed to the next), each at its own position. A request that ends (a stop
token, a stop string in its text, `max_tokens`, the end of the context) frees its slot
and pages, and the next waiting request takes them: continuous batching.

On a mesh: give it a model whose parameters are placed (a run's `inference_model()` on
its mesh). The compiled calls follow the parameters' shardings; the slots are split into
the data-parallel replicas of the mesh's batch axes (`Decoder.page_replicas`: data, fsdp,
expert, where they divide `max_slots`), each replica with a pool of its own and its slots'
pages in it, the key/value heads over `tensor`. A step's attention then reads only the
pages on its own devices, and each device holds its replica's pages alone; the replicas
prefill their waiting slots side by side, a row each; the tokens are one device's (tests).

The cache is the model's, one pytree the engine passes through its compiled calls unread:
each layer says what it keeps (its `cache_spec`, laid out by `Decoder.init_pages`), pages
of keys and values, or a state per slot, which the engine empties when it admits a request
to the slot (`Decoder.reset_slot`); each row is told its slot (`KVCache.slots`).

Pages: the keys and values live in a pool of `max_pages` pages of `page_size` positions,
and each slot has a block table, the pages of its positions in order. A request is
admitted when the pool has the pages its prompt and `max_tokens` can fill, which it holds
until it ends: memory follows the tokens requests may hold, not `max_len` per slot, and
a pool smaller than `max_slots` full rows (`max_pages`) serves as many short requests
at once as fit. (Reserved whole at admission rather than page by page as tokens come,
so a running request never waits for a page and nothing is preempted.) A step reads
only the table's first columns, as many pages as the longest running request needs,
rounded up to 1, 2, 3, 4, 6, 8, 12, ... (two compiled programs an octave), so its
attention follows the tokens held rather than `max_len` (`kernels.paged`).

Requests with the same prompt (a GRPO group, `n` completions of one prompt) prefill it once
in each replica: the others copy its pages and sample their first token from its logits
(`shared_prompts` counts them), bit for bit what their own prefill would have given.
Prompts that begin alike (a system prompt, a conversation going on) share the pages of each
whole prefill chunk they have in common, kept until the pool needs them, bit for bit again
(`page_pool`: automatic prefix caching; `prefix_hits`, `cached_tokens`, `cached_pages`).

Structured output: a request's `grammar` (`grammar`: llguidance) allows each token only what
keeps the output valid. While such a request runs, a call decodes one token (the next mask
needs the last): the model's step is dispatched, the masks computed on the host while it
runs, then the tokens sampled from its logits.

Speculative decoding (`speculation`): each step feeds a slot's guesses of what follows too,
and keeps those the model's own sampling confirms: the same output in fewer steps.

Batch-invariant: a request's tokens depend only on the request. Its prefill has a row
of its own in a call of fixed shape (a row per replica); in the decode step no row reads
another, and a page past a row's length adds exactly nothing to its attention, however
many pages the step reads; token i is sampled with `fold_in(key(seed), i)`. So a seeded
request gives the same tokens alone, among 31 others or admitted mid-way.

Example: two prompts of different lengths, greedy.
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import models
  >>> engine = Engine(models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0)), max_slots=2)
  >>> done = engine.run([Request((256, 104, 105), max_tokens=3, temperature=0),
  ...                    Request((256, 104), max_tokens=2, temperature=0)])
  >>> [len(c.tokens) for c in done], done[0].finish_reason
  ([3, 2], 'length')
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ai_stack.recipes.inference.programs import (first_token, first_tokens, forward,
                                                     half_octave, lower, padded_length,
                                                     page_copy, programs)
from jax_ai_stack.recipes.inference import grammar, requests as requests_lib
from jax_ai_stack.recipes.inference.page_pool import PagePool, chunk_keys
from jax_ai_stack.recipes.inference.requests import Completion, Request, RequestError
from jax_ai_stack.recipes.inference.slots import (Slot, prefill_calls, settings,
                                                  shared_prompts)
from jax_ai_stack.recipes.inference.speculation import Speculation, Speculator
from jax_ai_stack.recipes.inference.text import TextStream

__all__ = ["Completion", "Engine", "Request", "RequestError"]

class Engine:
  """Continuous batching over `max_slots` rows of a decoder's KV cache (see the module)."""

  def __init__(self, model: nnx.Module, *, max_slots: int = 8, max_len: int | None = None,
               max_top_logprobs: int = 5, steps_per_call: int = 4,
               decode: Callable[[list[int]], str] | None = None, page_size: int = 64,
               max_pages: int | None = None, prefill_chunk: int = 256,
               prefix_cache: bool = True, grammar_vocabulary=None,
               speculation: Speculation | None = None):
    """`model`: a decoder (`Decoder` and its families, LoRA merged, Qwix-quantized for
    `decode`); it is not modified. `max_len`: positions per slot (default: the model's
    `max_seq_len`). `max_top_logprobs`: the most alternatives a request may ask for.
    `steps_per_call`: tokens decoded per slot in one compiled call (a loop on the device):
    fewer round trips to the host (tiny model on CPU: 2x the tokens/s at 8 over 1), at the
    price of requests admitted or ended only between calls (a request that ends inside a
    call wastes the rest of it). The tokens and log-probs do not depend on it. `decode`:
    token ids to text (the tokenizer's): each completion's `text`, and requests' `stop`
    strings. `page_size`: positions per page of the KV cache; `max_pages`: the pool's
    pages (default: `max_slots` rows of `max_len`; on a mesh, split evenly among its
    data-parallel replicas). `prefill_chunk`: the most prompt tokens a request prefills
    per `step`, between the decoding calls of the others. `prefix_cache`: keep whole prompt
    chunks for the requests that begin alike (where `prefill_chunk` is whole pages and the
    model keeps no per-slot state). `grammar_vocabulary`: the tokenizer as the grammar engine
    reads it (`grammar.vocabulary`), for requests with a `grammar`; while one runs, each call
    decodes one token (see the module). `speculation`: tokens each step guesses and checks
    (`speculation`; a model whose cache is pages alone), the output unchanged."""
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call={steps_per_call} must be >= 1")
    if page_size < 1 or prefill_chunk < 1:
      raise ValueError(f"page_size={page_size} and prefill_chunk={prefill_chunk} must be >= 1")
    config = model.config
    self.max_slots, self.max_len = max_slots, max_len or config.max_seq_len
    if not 1 <= self.max_len <= config.max_seq_len:
      raise ValueError(f"max_len={max_len} must be in [1, model.max_seq_len="
                       f"{config.max_seq_len}]")
    self.vocab_size, self.max_top_logprobs = config.vocab_size, max_top_logprobs
    self.grammar_vocabulary = grammar_vocabulary
    if grammar_vocabulary is not None and grammar_vocabulary.vocab_size > self.vocab_size:
      raise ValueError(f"grammar_vocabulary has {grammar_vocabulary.vocab_size} tokens, more "
                       f"than the model's vocab_size={self.vocab_size}: not its tokenizer")
    self.detokenize = decode
    """The `decode` given (None: completions have no text, requests no stop strings)."""
    self.page_size = page_size
    self.pages_per_slot = -(-self.max_len // page_size)
    self.max_pages = max_pages or max_slots * self.pages_per_slot
    self.replicas = model.page_replicas(max_slots)
    """Data-parallel replicas: slot s and its pages live in replica s // (max_slots / replicas)."""
    if self.max_pages % self.replicas:
      raise ValueError(f"max_pages={max_pages} must be a multiple of the mesh's "
                       f"{self.replicas} data-parallel replicas (each holds a pool)")
    self.replica_pages = self.max_pages // self.replicas
    """The pages of one replica's pool: the most one request may hold."""
    graphdef, state = nnx.split(model)
    self._params, structure = jax.tree.flatten(state)
    self.steps_per_call, self.prefill_chunk = steps_per_call, prefill_chunk
    self._prefill, self._steps = programs(graphdef, structure, max_top_logprobs,
                                          steps_per_call)
    self._forward = forward(graphdef, structure)  # For grammars: masks while it runs.
    # Page 0 of each pool is never handed out: idle rows and positions past a table write
    # there. The cache is the model's (see the module).
    self.replica_slots = max_slots // self.replicas  # Slot s is its replica's s % this.
    cache = lambda of=model: of.init_pages(self.replica_pages + 1, page_size, self.replicas,
                                           slots=self.replica_slots)
    if any(isinstance(p, jax.ShapeDtypeStruct) for p in self._params):  # For `lower` only.
      placed = model.page_sharding(self.replicas)  # None, or a tree like the cache.
      abstract = lambda a, s=None: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
      self._cache = jax.tree.map(abstract, jax.eval_shape(cache), *[placed] * bool(placed))
    else:
      self._cache = cache()
    # Admission empties a slot's per-slot state (pages need none: a table names its own).
    per_slot = any(a.per_slot for spec in model.cache_specs() for a in spec.values())
    self._reset = jax.jit(model.reset_slot, donate_argnums=0) if per_slot else None
    self.speculator = speculation and Speculator(speculation, model, graphdef, structure,
                                                 max_top_logprobs, steps_per_call, cache)
    self._copy = None if per_slot else page_copy(  # Shared prompts' pages.
        tuple(tuple(spec.items()) for spec in model.cache_specs()), model.config.scan_layers)
    self._cache_chunk = (prefill_chunk if prefix_cache and self._copy is not None
                         and prefill_chunk % page_size == 0 else None)
    self.shared_prompts = self.prefix_hits = self.cached_tokens = 0
    """Requests whose prompt's pages were copied from another's, not prefilled; those that
    reused kept prompt chunks; the prompt tokens those chunks spared."""
    self._tables = np.zeros((max_slots, self.pages_per_slot), np.int32)  # Replicas' numbers.
    self._pools = [PagePool(self.replica_pages, prefill_chunk // page_size)
                   for _ in range(self.replicas)]
    self.peak_pages = 0  # The most pages held at once so far.
    self._slots: list[Slot | None] = [None] * max_slots
    self._waiting: collections.deque[tuple[int, Request, float, list]] = collections.deque()
    self._added = 0

  def lower(self, program: str) -> jax.stages.Lowered:
    """`program` ("prefill" or "decode") at its largest shapes, lowered (`programs.lower`):
    an engine of an abstract model (parameters placed on a chip's devices) lowers them for
    that chip, as `recipes.aot` does for chips this machine does not have."""
    return lower(program, self._prefill, self._steps, (self._params, self._cache),
                 self.replicas, padded_length(min(self.prefill_chunk, self.max_len),
                                              self.prefill_chunk),
                 self.max_slots, self.pages_per_slot)

  def run(self, requests: Sequence[Request]) -> list[Completion]:
    """A completion for each request, in the requests' order."""
    return sorted(self.stream(requests), key=lambda c: c.index)

  def stream(self, requests: Sequence[Request]) -> Iterator[Completion]:
    """Each request's completion as it finishes, `index` its place in `requests` (all are
    checked before any is queued; they are admitted in order)."""
    for index, request in enumerate(requests):
      self.check(request, index)
    first = self._added
    mine = range(first, first + len(requests))
    for request in requests:
      self._queue(request)
    while self.busy:
      for completion in self.step():
        if completion.finish_reason and completion.index in mine:
          yield dataclasses.replace(completion, index=completion.index - first)

  def add(self, request: Request) -> int:
    """Queues `request` (checked now: ValueError naming the field); returns its index, the
    number of requests added before it. It is admitted by a later `step`."""
    self.check(request, self._added)
    return self._queue(request)

  def _queue(self, request: Request) -> int:
    """Queues a checked request, its chunks' keys (its last token is always prefilled)."""
    index = self._added
    self._added += 1
    keys = chunk_keys(request.prompt[:-1], self._cache_chunk) if self._cache_chunk else []
    self._waiting.append((index, request, time.perf_counter(), keys))
    return index

  def cancel(self, index: int) -> bool:
    """Drops a waiting or running request (its client went away) and frees its slot and
    pages; whether it was there."""
    for entry in self._waiting:
      if entry[0] == index:
        self._waiting.remove(entry)
        return True
    for number, slot in enumerate(self._slots):
      if slot is not None and slot.index == index:
        self._release(number, slot)
        return True
    return False

  @property
  def busy(self) -> bool:
    """Whether a request waits or runs."""
    return bool(self._waiting) or any(slot is not None for slot in self._slots)

  @property
  def free_slots(self) -> int:
    return sum(slot is None for slot in self._slots)

  @property
  def pages_in_use(self) -> int:
    return sum(pool.held for pool in self._pools)

  @property
  def cached_pages(self) -> int:
    """Pages of kept prompt chunks, held or waiting for reuse (`page_pool`)."""
    return sum(pool.kept_pages for pool in self._pools)

  def _replica(self, number: int) -> int:
    """The replica that holds slot `number` (its rows are the mesh's in order)."""
    return number // (self.max_slots // self.replicas)

  def pages_for(self, request: Request) -> int:
    """The pages `request` holds while it runs: its prompt's and `max_tokens`' positions."""
    return -(-(len(request.prompt) + request.max_tokens) // self.page_size)

  def step(self) -> list[Completion]:
    """Admits waiting requests into free slots, prefills the next chunk of each prompt not
    yet in (a prompt that is in has its first token sampled), then decodes
    `steps_per_call` tokens for every slot past its prompt. Returns the completions that
    grew, once each; one with a `finish_reason` has ended and its slot is free again."""
    grown = []
    for number in range(self.max_slots):
      # In order: the first waiting request is admitted once the pool has its pages.
      if (self._slots[number] is None and self._waiting and self._pools[
          self._replica(number)].fits(self._waiting[0][3], self.pages_for(self._waiting[0][1]))):
        self._slots[number] = self._admit(number, *self._waiting.popleft())
    waiting = [(number, slot) for number, slot in enumerate(self._slots)
               if slot is not None and not slot.completion.tokens]
    waiting, shared = (shared_prompts(waiting, self._slots, self._replica)
                       if self._copy is not None and waiting else (waiting, []))
    calls = prefill_calls(waiting, self._replica,
                          lambda slot: padded_length(len(self._chunk(slot)), self.prefill_chunk))
    for length, call in calls:
      grown += [slot.completion for _, slot in self._prefill_next(length, call)]
    for number, slot in self._forked(shared):
      grown.append(slot.completion)
    for number, slot in enumerate(self._slots):
      if slot is not None and slot.completion.finish_reason:  # It ended at its first token.
        self._release(number, slot)
    if any(slot is not None and slot.completion.tokens for slot in self._slots):
      grown += self._decode()
    return list({completion.index: completion for completion in grown}.values())

  def check(self, request: Request, index: int = 0) -> None:
    """Raises `RequestError` (a ValueError) naming the request and the field that does not
    fit (`requests.check`)."""
    requests_lib.check(self, request, index)

  def _admit(self, number: int, index: int, request: Request, queued_at: float,
             keys: list[bytes]) -> Slot:
    """The request in slot `number`, given its pages (in the slot's table): the kept chunks
    its prompt begins with, then new ones."""
    pool = self._pools[self._replica(number)]
    pages = pool.reuse(keys)
    cached = len(pages) * self.page_size
    pages += pool.take(self.pages_for(request) - len(pages))
    self.prefix_hits += cached > 0
    self.cached_tokens += cached
    self.peak_pages = max(self.peak_pages, self.pages_in_use)
    self._tables[number, :len(pages)] = pages
    if self._reset is not None:
      self._cache = self._reset(self._cache, self._replica(number),
                                number % self.replica_slots)
    text = (None if self.detokenize is None else
            TextStream(self.detokenize, request.stop, request.stop_ids))
    matcher = (grammar.Matcher(self.grammar_vocabulary, request.grammar) if request.grammar
               else None)
    return Slot(index, request, Completion(index, [], [], ""), cached, text, pages, queued_at,
                keys=keys, grammar=matcher)

  def _forked(self, shared: list[tuple[int, Slot, Slot]]) -> list[tuple[int, Slot]]:
    """The slots of `shared` whose source has its prompt in: its prompt's pages copied into
    theirs (past those they hold in common: kept chunks), each first token sampled from the
    source's last prompt logits with the slot's own settings (`slots.shared_prompts`)."""
    ready = [(number, slot, source) for number, slot, source in shared
             if source.first_logits is not None]
    for replica in sorted({self._replica(number) for number, _, _ in ready}):
      pairs = [(page, mine) for number, slot, source in ready if self._replica(number) == replica
               for page, mine in list(zip(source.pages, slot.pages[
                   :-(-len(slot.request.prompt) // self.page_size)]))[
                       slot.length // self.page_size:]]
      copy = np.zeros((2, self.max_slots * self.pages_per_slot), np.int32)  # Page 0 to 0.
      copy[:, :len(pairs)] = np.asarray(pairs, np.int32).T
      self._cache = self._copy(self._cache, np.int32(replica), copy[0], copy[1])
      if self.speculator:  # A draft model's pages too.
        self.speculator.copy(np.int32(replica), copy[0], copy[1])
    if ready:  # Their first tokens in one call of max_slots rows (idle rows greedy).
      rows = [source.first_logits for _, _, source in ready]
      logits = jnp.stack(rows + rows[:1] * (self.max_slots - len(rows)))
      slots = [slot for _, slot, _ in ready] + [None] * (self.max_slots - len(ready))
      sampled = [np.asarray(x) for x in first_tokens(logits, *self._settings(slots),
                                                     self.max_top_logprobs)]
    for row, (number, slot, source) in enumerate(ready):
      slot.length, slot.first_logits = len(slot.request.prompt), source.first_logits
      slot.take(*[x[row] for x in sampled])
    self.shared_prompts += len(ready)
    return [(number, slot) for number, slot, _ in ready]

  def _chunk(self, slot: Slot) -> tuple[int, ...]:
    """The part of `slot`'s prompt that its next prefill takes."""
    return slot.request.prompt[slot.length:slot.length + self.prefill_chunk]

  def _prefill_next(self, length: int, call: dict[int, tuple]) -> list[tuple[int, Slot]]:
    """The next chunk of each slot's prompt in `call` (`slots.prefill_calls`) into its pages, in
    one compiled call: the slot in its replica's row, the other rows idle at page 0 of
    their pools (chunks padded to `length`, a power of two, so that lengths share a few
    programs). A slot whose prompt is then in has its first token sampled: those
    (number, slot)."""
    chunks = {replica: self._chunk(slot) for replica, (_, slot) in call.items()}
    width = self._width(max(slot.length for _, slot in call.values()) + length)
    tokens = np.zeros((self.replicas, length), np.int32)
    starts, lasts = np.zeros((2, self.replicas), np.int32)
    table = np.zeros((self.replicas, width), np.int32)
    rows = np.full((self.replicas,), self.replica_slots, np.int32)  # Idle: past the last.
    for replica, (number, slot) in call.items():
      tokens[replica, :len(chunks[replica])] = chunks[replica]
      starts[replica], lasts[replica] = slot.length, len(chunks[replica]) - 1
      table[replica] = self._tables[number, :width]
      rows[replica] = number % self.replica_slots
    logits, self._cache = self._prefill(self._params, self._cache, tokens, starts, table,
                                        rows, lasts)
    if self.speculator:  # A draft model's pages too.
      self.speculator.prefill(tokens, starts, table, rows, lasts)
    done = []
    for replica, (number, slot) in call.items():
      slot.length += len(chunks[replica])
      if self._cache_chunk and slot.length % self._cache_chunk == 0:  # For prompts like it.
        self._pools[replica].keep(slot.keys, slot.pages, slot.length // self._cache_chunk)
      if slot.length == len(slot.request.prompt):
        slot.first_logits = logits[replica]  # For the slots that share its prompt.
        sampled = first_token(logits, np.int32(replica), *self._settings([slot]),
                              self.max_top_logprobs)
        slot.take(*[np.asarray(x)[0] for x in sampled])
        done.append((number, slot))
    return done

  def _width(self, positions: int) -> int:
    """Table columns that cover `positions` positions, rounded up to 1, 2, 3, 4, 6, 8, 12,
    ... (two compiled programs an octave): the table a call gets. The Pallas kernels read
    all of it (at most a third unneeded, where powers of two read up to twice the pages);
    the xla loop stops at what its rows need."""
    return min(half_octave(-(-positions // self.page_size)), self.pages_per_slot)

  def _decode(self) -> list[Completion]:
    """`steps_per_call` tokens for every occupied slot (fewer for one that ends); the
    completions that grew."""
    slots = [slot if slot is not None and slot.completion.tokens else None
             for slot in self._slots]  # A slot still prefilling sits this call out.
    tokens, lengths = np.zeros((2, self.max_slots), np.int32)
    for number, slot in enumerate(slots):
      if slot is not None:
        tokens[number], lengths[number] = slot.completion.tokens[-1], slot.length
    constrained = any(slot is not None and slot.grammar for slot in slots)
    speculating = self.speculator is not None and not constrained
    count = (1 if constrained else self.steps_per_call
             * (1 + self.speculator.speculation.tokens if speculating else 1))
    produced = np.full((self.max_slots,), count)  # Tokens each row takes from the call.
    width = self._width(max(slot.length for slot in slots if slot is not None) + count)
    table = self._tables[:, :width].copy()
    idle = [slot is None for slot in slots]
    table[idle] = 0  # Idle rows write to page 0 only, and to no slot's state.
    rows = np.arange(self.max_slots, dtype=np.int32) % self.replica_slots
    rows[idle] = self.replica_slots
    if constrained:  # The step runs while the host computes the grammars' masks.
      logits, self._cache = self._forward(self._params, self._cache, tokens, lengths, table,
                                          rows)
      sampled = [x[None] for x in first_tokens(logits, *self._settings(slots),
                                               self.max_top_logprobs)]
    elif speculating:  # Each row's last token and drafts, checked in one pass.
      *sampled, produced, guesses, self._cache = self.speculator(
          self._params, self._cache, slots, lengths, table, rows, self._settings(slots),
          self.page_size)
    else:
      *sampled, self._cache = self._steps(self._params, self._cache, tokens, lengths, table,
                                          rows, *self._settings(slots))
    new_tokens, logps, top_tokens, top_logps = (np.asarray(x) for x in sampled)  # [steps, B]
    grown = []
    for number, slot in enumerate(slots):
      if slot is None:
        continue
      grown.append(slot.completion)
      for step in range(produced[number]):
        slot.length += 1
        if slot.take(new_tokens[step, number], logps[step, number],
                      top_tokens[step, number], top_logps[step, number]):
          self._release(number, slot)  # Its later tokens (and cache positions) are dropped.
          break
      if speculating:  # The guesses made and kept with the tokens it took.
        self.speculator.tally(slot.completion, guesses[:step + 1, number])
    return grown

  def _release(self, number: int, slot: Slot) -> None:
    """Frees slot `number` and the pages `slot` held (rewritten by whoever gets them)."""
    self._slots[number] = None
    self._pools[self._replica(number)].give_back(slot.pages)
    self._tables[number] = 0

  def _settings(self, slots: Sequence[Slot | None]) -> tuple[np.ndarray, ...]:
    return settings(slots, self.vocab_size)
