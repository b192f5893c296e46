"""The language-model Task: a decoder (Llama, Qwen, Mistral, Gemma) trained on next-token
prediction.

Reads a token corpus (`data.source` stdlib/text/npy/arrayrecord/parquet),
reports eval loss and perplexity, counts throughput in tokens and leaves a
generated sample (`sample.txt`) at the end of a run.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> task = LanguageModel(config.load("lm-tiny"))
  >>> task.items_per_step, task.throughput_unit
  (1024, 'tokens')
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from flax import nnx

from jax_ai_stack import kernels, logs
from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import ConfigError, UsageError
from jax_ai_stack.recipes import data, inference, progress, sharding
from jax_ai_stack.recipes.models import adapting, decoder
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.models.hf import special_tokens
from jax_ai_stack.recipes.tasks import distillation, grpo, objectives
from jax_ai_stack.recipes.tasks.base import Task

SAMPLE_FILE = "sample.txt"
DEFAULT_SAMPLE_PROMPT = "def "
"""A text run's end-of-run sample continues this where `train.sample_prompt` is None."""
DEFAULT_NEW_TOKENS = 128
"""`generate` without a length: this many new tokens, or as many as fit `max_seq_len`."""
MAX_SLOTS = 8
"""The most requests the generation engine decodes at once for `generate_many` / `chat_many`."""


class LanguageModel(Task):
  """Next-token prediction with the Llama decoder on a token corpus."""

  model_config = DecoderConfig
  throughput_unit = "tokens"
  quant_layers = adapting.QUANT_LAYERS[DecoderConfig]
  methods = ("__call__", "decode")  # `decode`: a step of generation, with a KV cache.

  def build_model(self, seed: int, attention: kernels.AttentionPlan | None = None,
                  layout: sharding.Layout | None = None) -> Decoder:
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    return Decoder(self.config.model, rngs=rngs, attention=attention, layout=layout)

  @functools.cached_property
  def objective(self) -> objectives.Objective:
    """What the model learns: the next token, DPO on preference data, distillation from a
    teacher (`objectives`), or the GRPO family on prompts (`grpo`); on prompts with a
    teacher, distillation on the completions the model samples (on-policy)."""
    if self.config.finetune.distill.teacher is not None:  # Text, chats, or sampled replies.
      return distillation.for_config(self.config.finetune.distill)
    if self.config.data.is_prompts:
      return grpo.for_config(self.config)
    return objectives.for_config(self.config)

  @property
  def data_kind(self) -> str:
    data_config = self.config.data
    if data_config.is_prompts:
      return "prompts"
    return "preference" if data_config.is_preference else "tokens"

  @functools.cached_property
  def rollouts(self):
    """What turns a batch of prompts into a batch to train on (`rl.Rollouts`), for a run on
    prompts; None for any other."""
    if not self.config.data.is_prompts:
      return None
    from jax_ai_stack.recipes.rl import rollout  # pylint: disable=g-import-not-at-top

    return rollout.Rollouts(self.config, self.tokenizer(), self.prompt_encoder())

  def loss(self, model, batch):
    """The objective's loss without a run's transforms (DPO: refused, it has no reference)."""
    return objectives.training_loss(self.objective)(model, batch)

  def data_metrics(self, step: int) -> dict[str, float]:
    """A mixture's tokens per component so far (`tokens_<name>`)."""
    data_config = self.config.data
    if data_config.mixture is None:
      return {}
    rows = self._mixture_rows.rows_before(data.BatchSchedule.of(data_config).first_row(step))
    return {f"tokens_{name}": float(n * data_config.seq_len)
            for name, n in zip(self._mixture_rows.names, rows)}

  @functools.cached_property
  def _mixture_rows(self) -> data.MixtureRows:
    return data.mixture_rows(self.config.data, self.config.train.seed)

  def dataset(self, split: str, seed: int):
    if split == "validation" and self.config.data.mixture is not None:
      return data.validation_sets(self.config.data, seed=seed)  # Each component's own.
    return data.build_dataset(self.config.data, split=split, seed=seed)

  @property
  def items_per_step(self) -> int:
    return self.config.data.batch_size * self.config.data.seq_len

  def batch_axes(self) -> dict[str, tuple[str, ...]]:
    return self.objective.batch_axes()

  def batch_spec(self, rows: int) -> dict[str, Any]:
    """`rows` prompts of a run on prompts train as that many groups of completions."""
    if self.config.data.is_prompts:
      rows *= self.config.rl.num_generations
    return self.objective.batch_spec(rows, self.config.data.seq_len)

  def tokenizer(self) -> data.Tokenizer:
    return self._tokenizer

  @functools.cached_property
  def _tokenizer(self) -> data.Tokenizer:
    """Built once per Task (generation, serving and evaluation each ask several times)."""
    return data.build_tokenizer(self.config.data)

  def check_data(self) -> None:
    vocabulary = self.tokenizer().vocab_size
    if vocabulary > self.config.model.vocab_size:
      raise ConfigError(
          f"model.vocab_size={self.config.model.vocab_size} is smaller than the tokenizer's "
          f"vocabulary ({vocabulary} ids)"
      )

  def attention_implementation(self) -> str:
    return self.config.model.attention_impl

  def attention_request(self) -> kernels.Request:
    """The training step's attention: the global batch (what the jitted step traces), causal,
    with segment ids, and the first layer's window, scale and soft cap (a model with
    local and global layers also runs the other layers' request)."""
    model, batch = self.config.model, self.config.data.batch_size
    seq_len, head_dim = self.config.data.seq_len, model.resolved_head_dim
    return kernels.Request.from_shapes(
        (batch, seq_len, model.num_heads, head_dim),
        (batch, seq_len, model.num_kv_heads, head_dim),
        model.dtype, causal=True, segment_ids=True, local_window=model.local_window(0),
        scale=model.attention_scale,
        logits_soft_cap=model.attn_logit_softcap,
    )

  def activation_bytes(self, ways, attention, platform="cpu") -> tuple[int, str] | None:
    model = self.config.model
    if model.moe is not None or model.latent_attention or model.linear_attention:  # Rows per
      return None  # expert vary; latents and DeltaNet states are not in the estimate: measured.
    fused = platform != "cpu"
    per_row = decoder.activation_bytes(model, self.config.data.seq_len, ways, attention,
                                       fused=fused)
    kept = "keeps T x T scores" if attention in decoder.MATERIALIZING_ATTENTION else "(flash)"
    return per_row, (f"analytic: remat {model.remat}, attention {attention} {kept}"
                     f"{f', as XLA:{platform.upper()} fuses' if fused else ''}")

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    return self.objective.evaluation(means)

  def kernel_report(self) -> list[str]:
    """The experts' grouped matmul of a mixture-of-experts model (`kernels.experts`)."""
    moe = self.config.model.moe
    if moe is None:
      return []
    name, why = kernels.choose_grouped_matmul(moe.grouped_matmul)
    return [f"grouped matmul: {name} ({why})"]

  def artefacts(self) -> list[str]:
    return [SAMPLE_FILE] if self.config.train.sample_tokens else []

  def finish(self, model, workdir: pathlib.Path | None) -> list[str]:
    train = self.config.train
    if not train.sample_tokens:
      return []
    item = self.sample_item()
    # Said at once, with tokens/s after: at a real model's size on a CPU it takes minutes.
    with progress.waiting(f"sampling {train.sample_tokens} tokens", first=0,
                          done=lambda wait: _sampled(done["tokens"], wait.elapsed_s)):
      [done] = self.stream(model, [item], train.sample_tokens, train.sample_temperature,
                           train.seed)
    text = done["text"]
    if "messages" in item:  # A reply: shown after the turns it answers.
      text = "".join(f"{m['role']}: {m['content']}\n" for m in item["messages"])
      text += f"assistant: {done['text']}"
    if workdir is not None:
      write_atomically(workdir / SAMPLE_FILE, text)
    return [f"sample:\n{text}\n"]

  def sample_item(self) -> dict:
    """The end-of-run sample's request (`stream`'s item): `train.sample_prompt` where set (a
    user turn for a chat, DPO or RL run; text to continue otherwise); else a chat, DPO or
    RL run's first held-out prompt of its own data, as its rollouts or its template would
    render it (the train split's where none is held out), and a text run's "def "."""
    prompt, data_config = self.config.train.sample_prompt, self.config.data
    turns = data_config.is_chat or data_config.is_prompts
    if prompt is not None:
      return {"messages": [{"role": "user", "content": prompt}]} if turns else {"prompt": prompt}
    if not turns:
      return {"prompt": DEFAULT_SAMPLE_PROMPT}
    if data_config.is_prompts:
      splits = data.prompts.load_prompts(data_config)
      record = (splits["validation"].records or splits["train"].records)[0]
      return {k: record[k] for k in ("messages", "prompt") if k in record}
    load = data.preference.load_preferences if data_config.is_preference else data.chat.load_chat
    splits = load(data_config)
    return {"messages": splits["validation"].prompt or splits["train"].prompt}

  def generate(self, model, prompt: str, max_new_tokens: int | None, temperature: float,
               seed: int, *, top_k: int | None = None, top_p: float | None = None,
               ignore_eos: bool = False) -> str:
    """`prompt` continued by up to `max_new_tokens` tokens (fewer if the model's
    `max_seq_len` is reached first: a note says so); None: 128, or as many as fit. It ends
    at the model's end-of-sequence ids (`end_ids`) unless `ignore_eos`."""
    return self.generate_many(model, [prompt], max_new_tokens, temperature, seed,
                              top_k=top_k, top_p=top_p, ignore_eos=ignore_eos)[0]

  def generate_many(self, model, prompts: list[str], max_new_tokens: int | None,
                    temperature: float, seed: int, *, top_k: int | None = None,
                    top_p: float | None = None, ignore_eos: bool = False) -> list[str]:
    """Each prompt continued as `generate` does, all in one batch of the generation engine
    (each with `seed`: a prompt's text does not depend on the others)."""
    done = self.stream(model, [{"prompt": prompt} for prompt in prompts], max_new_tokens,
                       temperature, seed, top_k=top_k, top_p=top_p, ignore_eos=ignore_eos)
    return [result["text"] for result in sorted(done, key=lambda r: r["index"])]

  def chat(self, model, messages: list[dict], max_new_tokens: int | None, temperature: float,
           seed: int, *, top_k: int | None = None, top_p: float | None = None) -> str:
    """The assistant's reply to `messages` (ending with a user turn), rendered with the run's
    chat template and its generation prompt; the reply stops before the first end-of-turn
    token (the tokenizer's EOS, or a turn token such as `<|im_end|>` its file defines)."""
    return self.chat_many(model, [messages], max_new_tokens, temperature, seed,
                          top_k=top_k, top_p=top_p)[0]

  def chat_many(self, model, conversations: list[list[dict]], max_new_tokens: int | None,
                temperature: float, seed: int, *, top_k: int | None = None,
                top_p: float | None = None) -> list[str]:
    """Each conversation's reply as `chat` gives it, all in one batch of the engine."""
    done = self.stream(model, [{"messages": messages} for messages in conversations],
                       max_new_tokens, temperature, seed, top_k=top_k, top_p=top_p)
    return [result["text"] for result in sorted(done, key=lambda r: r["index"])]

  def stream(self, model, items: list[dict], max_new_tokens: int | None, temperature: float,
             seed: int, *, top_k: int | None = None, top_p: float | None = None,
             ignore_eos: bool = False,
             speculation: inference.Speculation | None = None) -> Iterator[dict]:
    """Each item's result as it finishes, from one batch of the generation engine.

    An item is {"prompt": text} (continued, the prompt included in the text, as
    `generate`, up to the model's end-of-sequence ids unless `ignore_eos`) or
    {"messages": [...]} (answered as `chat`: the reply alone, cut at its end of
    turn), with an optional "stop": strings that end it (the engine stops there;
    the text ends before the first), and an optional "grammar" its new text follows
    (`inference.grammar`). Yields {"index", "text", "finish_reason"
    ("stop" or "length"), "tokens" (new tokens, an end id included), "first_token_s"
    (seconds from its queueing in the engine to its first token)} with `index` the
    item's place in `items`. With `speculation` (`inference.speculation`: the same
    output), each also says how many tokens were guessed for it and how many kept
    ("drafted", "accepted").
    """
    tokenizer, encode = self.tokenizer(), self.prompt_encoder()
    chats = ["messages" in item for item in items]
    prompts, stop_ids = zip(*(encode(item) for item in items)) if items else ((), ())
    if ignore_eos:  # A continuation goes on to its length; a reply still ends its turn.
      stop_ids = [ids if chat else () for ids, chat in zip(stop_ids, chats)]
    ends = tokenizer.end_of_turn_ids()
    requests, lengths = self._requests(list(prompts), max_new_tokens, temperature, seed,
                                       top_k, top_p, list(stop_ids))
    stops = [tuple(item.get("stop", ())) for item in items]
    requests = [dataclasses.replace(r, stop=stop, grammar=item.get("grammar"))
                for r, stop, item in zip(requests, stops, items)]
    decode = lambda ids: tokenizer.decode(np.asarray(ids, np.int32))
    engine = inference.Engine(model, max_slots=min(len(requests), MAX_SLOTS),
                              max_len=inference.slot_length(requests, self.config.model.max_seq_len),
                              decode=decode if any(stops) else None,  # Text only for stops.
                              grammar_vocabulary=inference.grammar.vocabulary(tokenizer)
                              if any(r.grammar for r in requests) else None,
                              speculation=speculation)
    for index, request in enumerate(requests):
      try:
        engine.check(request, index)  # A sampling setting out of range: the user's mistake.
      except ValueError as e:
        raise UsageError(str(e)) from None
    for completion in engine.stream(requests):
      index = completion.index
      new = np.asarray(completion.tokens[:lengths[index]], np.int32)
      if chats[index]:
        turn_ends = np.isin(new, ends)
        text, start = tokenizer.decode(new[:np.argmax(turn_ends)] if turn_ends.any() else new), 0
      else:
        ended = completion.finish_reason == "stop" and new.size and new[-1] in stop_ids[index]
        text = tokenizer.decode(np.concatenate([prompts[index], new[:-1] if ended else new]))
        start = len(tokenizer.decode(prompts[index]))
      found = [at for at in (text.find(stop, start) for stop in stops[index]) if at >= 0]
      text = text[:min(found)] if found else text
      guesses = ({"drafted": completion.drafted, "accepted": completion.accepted}
                 if speculation else {})
      yield {"index": index, "text": text, "finish_reason": completion.finish_reason,
             "tokens": int(new.size), "first_token_s": completion.first_token_s, **guesses}

  def prompt_encoder(self) -> Callable[[dict], tuple[np.ndarray, tuple[int, ...]]]:
    """A function from an item to its prompt's ids and the ids that end its reply.

    {"prompt": text}: the text as the tokenizer encodes a prompt (BOS where its
    file adds one; BOS alone for no text), ended by the model's end-of-sequence
    ids (`end_ids`). {"messages": [...]}: the conversation rendered with the
    run's chat template and its generation prompt (and "tools", the functions it may call;
    "reply_start", text the reply begins with), ended by the tokenizer's end-of-turn ids.
    Both only those inside the model's vocabulary.
    """
    tokenizer = self.tokenizer()
    turn_ends = tuple(int(t) for t in tokenizer.end_of_turn_ids()
                      if t < self.config.model.vocab_size)
    ends = self.end_ids()
    template = None

    def encode(item: dict) -> tuple[np.ndarray, tuple[int, ...]]:
      nonlocal template
      if "messages" in item:
        template = template or data.chat_template.for_data(self.config.data, tokenizer)
        rendered = template.render(item["messages"], add_generation_prompt=True,
                                   tools=item.get("tools"))
        return tokenizer.encode_rendered(rendered + item.get("reply_start", "")), turn_ends
      ids = tokenizer.encode_prompt(item["prompt"])
      return (ids if ids.size else np.asarray([tokenizer.bos_id], np.int32)), ends

    return encode

  def end_ids(self) -> tuple[int, ...]:
    """The ids that end a prompt's continuation, as transformers' `generate` ends it on the
    export (`hf.special_tokens.end_ids`): an imported model's generation_config.json's
    `eos_token_id`, else the tokenizer's EOS and end-of-turn ids; those inside the
    model's vocabulary."""
    tokenizer, data_config = self.tokenizer(), self.config.data
    path = data_config.tokenizer_path if data_config.tokenizer == "huggingface" else None
    ids = special_tokens.end_ids(path, eos=tokenizer.eos_id,
                                 end_of_turn=tokenizer.end_of_turn_ids())
    return tuple(int(t) for t in ids if 0 <= t < self.config.model.vocab_size)

  def _requests(self, prompts: list[np.ndarray], max_new_tokens: int | None,
                temperature: float, seed: int, top_k: int | None, top_p: float | None,
                stop_ids: list[tuple[int, ...]]) -> tuple[list[inference.Request], list[int]]:
    """The engine's requests for `prompts` (each as many new tokens as fit `max_seq_len`,
    with a note where fewer than asked), and how many new tokens each keeps."""
    limit = self.config.model.max_seq_len
    if max_new_tokens is not None and max_new_tokens < 1:
      raise UsageError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
    requests, lengths = [], []
    for prompt_ids, stops in zip(prompts, stop_ids):
      room = limit - prompt_ids.size
      if room <= 0:
        raise ConfigError(f"the prompt is {prompt_ids.size} tokens, more than "
                          f"model.max_seq_len ({limit})")
      wanted = min(DEFAULT_NEW_TOKENS, room) if max_new_tokens is None else max_new_tokens
      if wanted > room:
        logs.note(f"generating {room} tokens, not {wanted}: the prompt ({prompt_ids.size} "
                  f"tokens) and the new tokens must fit model.max_seq_len={limit}")
      lengths.append(min(wanted, room))
      requests.append(inference.Request(tuple(int(t) for t in prompt_ids), lengths[-1],
                                        temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, stop_ids=stops))
    return requests, lengths


def _sampled(tokens: int, seconds: float) -> str:
  """The end-of-run sample's closing line.

  Example:
    >>> _sampled(120, 40.0)
    'sampled 120 tokens in 40.0 s (3.0 tokens/s)'
  """
  return f"sampled {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)"
