"""`DataConfig`: what the data recipes read, tokenize and batch.

Every source but two is a token corpus (documents -> tokens -> windows or
packed rows); `digits` is a labelled image set, and `custom` says that the
batches come from a Task of your own (`model.kind: custom`), not from here.
`DataConfig.is_token_source` is the one place that says which, and
`require_token_source` the one error for asking another source for tokens.

Example:
  >>> config = DataConfig(source="text", paths=("corpus/*.txt",), seq_len=64)
  >>> config.is_token_source, config.holdout_fraction
  (True, 0.05)
  >>> digits = DataConfig(source="digits")
  >>> digits.is_token_source, digits.holdout_fraction
  (False, 0.2)
  >>> require_token_source(digits, "vocabulary")
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.ConfigError: data.source='digits' is a labelled image set, not text or
  tokens: it has no vocabulary; use one of stdlib, text, npy, arrayrecord, parquet
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.configlib import config_dataclass

Source = Literal["stdlib", "text", "npy", "arrayrecord", "parquet", "chat", "chat_stdlib",
                 "chat_arithmetic", "chat_reversal",
                 "preference", "preference_stdlib", "prompts", "prompts_arithmetic",
                 "prompts_reversal", "digits", "custom"]
TokenizerName = Literal["byte", "huggingface", "sentencepiece"]

# Sources whose files are listed in `paths`.
_PATH_SOURCES = ("text", "npy", "arrayrecord", "parquet")
# Sources of documents that become tokens; the others are images with labels.
TOKEN_SOURCES = ("stdlib", *_PATH_SOURCES)
# Conversations rendered with a chat template, the loss on the assistant's tokens (`chat`).
CHAT_SOURCES = ("chat", "chat_stdlib", "chat_arithmetic", "chat_reversal")
# Pairs of replies to one prompt, the first preferred: what DPO trains on (`preference`).
PREFERENCE_SOURCES = ("preference", "preference_stdlib")
# Prompts a policy answers, with what its rewards read: reinforcement learning (`prompts`).
PROMPT_SOURCES = ("prompts", "prompts_arithmetic", "prompts_reversal")
# Sources made from the standard library's own files (`data.paths`: patterns within it).
STDLIB_SOURCES = ("stdlib", "chat_stdlib", "preference_stdlib")


@config_dataclass
class MixtureComponent:
  """One corpus of a mixture (`data.mixture.components.NAME`): any token source, with its
  own files and token cache; the tokenizer, lengths and split come from `data`."""

  source: Source = "stdlib"
  """stdlib, text, npy, arrayrecord or parquet (as `data.source`)."""
  paths: tuple[str, ...] = ()
  """Files or globs for text/npy/arrayrecord/parquet; stdlib: optional patterns ("logging/*")."""
  text_column: str = "text"
  """parquet: the column holding one document per row."""
  max_documents: int | None = None
  """Keep the first N non-empty documents in source order; None: `data.max_documents`."""
  cache: str | None = None
  """This component's TensorStore token cache (as `data.cache`)."""


@config_dataclass
class MixtureStage:
  """From `step` on, the share of each batch's rows each component feeds."""

  step: int = 0
  """The first step of this stage (the first stage starts at 0)."""
  weights: dict[str, float] = dataclasses.field(default_factory=dict)
  """Component name -> weight (>= 0; normalised; a component left out gets 0)."""


@config_dataclass
class MixtureConfig:
  """Several corpora in one stream, with weights that change at named steps (`data.mixture`).

  Which component feeds each row of each batch is a pure function of (seed, step,
  row) (`data.mixture`'s module says how), so resume and random access need nothing
  saved beyond the step. Evaluation reports each component's held-out loss.
  """

  components: dict[str, MixtureComponent] = dataclasses.field(default_factory=dict)
  """Name (letters, digits, _ and -) -> its corpus."""
  stages: tuple[MixtureStage, ...] = ()
  """The weights from each stage's step on; the first at step 0, steps increasing."""

  def __post_init__(self):
    if not self.components:
      raise ConfigError("data.mixture.components: name at least one corpus")
    for name, component in self.components.items():
      where = f"data.mixture.components.{name}"
      if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ConfigError(f"{where}: a name of letters, digits, _ and - (it names metrics)")
      if component.source not in TOKEN_SOURCES:
        raise ConfigError(f"{where}.source={component.source!r}: a mixture mixes token "
                          f"corpora ({', '.join(TOKEN_SOURCES)})")
      if component.source in _PATH_SOURCES and not component.paths:
        raise ConfigError(f"{where}.paths: source={component.source!r} needs at least one "
                          "file or glob")
    if not self.stages:
      raise ConfigError("data.mixture.stages: give at least one stage, "
                        "[{step: 0, weights: {NAME: 1.0, ...}}]")
    if self.stages[0].step != 0:
      raise ConfigError(f"data.mixture.stages[0].step={self.stages[0].step}: the first stage "
                        "starts at step 0")
    for i, (before, stage) in enumerate(zip(self.stages, self.stages[1:]), start=1):
      if stage.step <= before.step:
        raise ConfigError(f"data.mixture.stages[{i}].step={stage.step} goes back in time: "
                          f"it must come after the stage before (step {before.step})")
    for i, stage in enumerate(self.stages):
      unknown = sorted(set(stage.weights) - set(self.components))
      if unknown:
        raise ConfigError(f"data.mixture.stages[{i}].weights: {', '.join(unknown)} is no "
                          f"component; components: {', '.join(self.components)}")
      if any(w < 0 for w in stage.weights.values()) or not sum(stage.weights.values()) > 0:
        raise ConfigError(f"data.mixture.stages[{i}].weights={dict(stage.weights)}: weights "
                          "must be >= 0 and sum to a positive number")

  def weights(self, stage: MixtureStage) -> list[float]:
    """The stage's weight of each component, in `components` order."""
    return [float(stage.weights.get(name, 0.0)) for name in self.components]


@config_dataclass
class BatchStage:
  """From `step` on, `batch_size` rows per step (`data.batch_schedule`)."""

  step: int = 1
  """The first step with this batch size, counted as the logs count steps done (> 0)."""
  batch_size: int = 8
  """Global rows per step from `step` on."""


@config_dataclass
class DataConfig:
  """What a run reads and how it is batched (the `data` section of a recipe).

  `data.build_dataset(config, split=..., seed=...)` turns it into this
  process's batches; the fields below name the corpus, the tokenizer, the
  sequence length, the global batch size and the train/validation split.
  """

  source: Source = "stdlib"
  """stdlib: the standard library's .py files; text/npy/arrayrecord/parquet: `paths`; chat:
  JSONL conversations in `paths`; chat_stdlib: question-answer pairs about the standard
  library's functions; preference: JSONL pairs of replies (DPO); preference_stdlib: right
  answers to chat_stdlib's questions over the same answers damaged; chat_arithmetic: sums
  and differences with their replies ("85 - 63 = 22"); chat_reversal: words and their
  reversals ("evq -> qve"); prompts: JSONL prompts with the columns rewards read
  (reinforcement learning, the `rl` section); prompts_arithmetic, prompts_reversal: the same
  questions asked, the answer a column; digits; custom: your Task's own `dataset` (with
  `model.kind: custom`), nothing read here."""
  paths: tuple[str, ...] = ()
  """Files or globs (`**` recurses) for text/npy/arrayrecord/parquet; each must match a file.
  stdlib: optional patterns relative to the standard library's root ("logging/*"): only those files."""
  text_column: str = "text"
  """parquet: the column holding one document per row."""
  tokenizer: TokenizerName = "byte"
  """byte: 256 bytes + BOS/EOS/PAD (no file); huggingface: tokenizer.json; sentencepiece: .model."""
  tokenizer_path: str | None = None
  """The tokenizer file for huggingface/sentencepiece."""
  seq_len: int = 128
  """Tokens per example (T); targets are the inputs shifted by one."""
  batch_size: int = 8
  """GLOBAL batch size; each process gets batch_size // process_count rows."""
  batch_schedule: tuple[BatchStage, ...] = ()
  """Batch sizes that change at named steps, [{step: 1000, batch_size: 16}, ...]: each from
  its step on (`data.batch_size` before the first). Evaluation keeps `data.batch_size`."""
  packing: bool = False
  """False: windows of seq_len+1 over the token stream; True: documents packed with segment ids."""
  validation_fraction: float | None = None
  """Share of chunks (digits: images) held out by hash; None: 0.05, or 0.2 for digits."""
  split_chunk_tokens: int = 512
  """Documents are cut into chunks of this many tokens before the train/validation split, so
  one long file gives both splits; smaller chunks suit smaller corpora."""
  max_documents: int | None = None
  """Keep the first N non-empty documents in source order (the stdlib corpus is ~30 MB)."""
  num_workers: int = 0
  """Grain `mp_prefetch` worker processes; 0: batches are built in a thread of this process."""
  encoding_errors: Literal["replace", "ignore", "strict"] = "replace"
  """Invalid UTF-8: replace by U+FFFD, drop, or raise an error naming the file and byte."""
  prefetch_batches: int = 4
  """Batches built ahead in the background, per process (and per worker); 0 disables."""
  cache: str | None = None
  """A TensorStore token cache (a directory or a kvstore URL such as file:// or memory://)
  read per batch instead of tokenizing into memory; prepared first if missing."""
  chat_template: str | None = None
  """chat sources: a .jinja file to render conversations with; None: the tokenizer's own
  (chat_template.jinja or tokenizer_config.json beside data.tokenizer_path), or the built-in
  template of the byte tokenizer."""
  max_bad_lines: int = 0
  """chat: bad JSONL lines skipped and counted before the first one is an error."""
  mixture: MixtureConfig | None = None
  """Several corpora mixed by weights that change at named steps; they replace `source`,
  `paths`, `text_column`, `max_documents` and `cache`, which stay unset."""

  def __post_init__(self):
    if self.seq_len < 1:
      raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")
    if self.batch_size < 1:
      raise ConfigError(f"data.batch_size must be >= 1, got {self.batch_size}")
    for i, stage in enumerate(self.batch_schedule):
      where = f"data.batch_schedule[{i}]"
      if stage.batch_size < 1:
        raise ConfigError(f"{where}.batch_size must be >= 1, got {stage.batch_size}")
      before = self.batch_schedule[i - 1].step if i else 0
      if stage.step <= before:
        raise ConfigError(f"{where}.step={stage.step} goes back in time: it must come after "
                          + (f"the entry before (step {before})" if i else
                             "step 0 (data.batch_size is the batch until the first entry)"))
    if self.num_workers < 0:
      raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")
    if self.prefetch_batches < 0:
      raise ConfigError(f"data.prefetch_batches must be >= 0, got {self.prefetch_batches}")
    if self.split_chunk_tokens < 1:
      raise ConfigError(f"data.split_chunk_tokens must be >= 1, got {self.split_chunk_tokens}")
    if self.max_documents is not None and self.max_documents < 1:
      raise ConfigError(f"data.max_documents must be >= 1 or None, got {self.max_documents}")
    if self.validation_fraction is not None and not 0 <= self.validation_fraction < 1:
      raise ConfigError(
          f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}"
      )
    if self.source in (*_PATH_SOURCES, "chat", "preference", "prompts") and not self.paths:
      raise ConfigError(f"data.paths: source={self.source!r} needs at least one file or glob")
    if (self.source not in (*_PATH_SOURCES, *CHAT_SOURCES, *PREFERENCE_SOURCES, "prompts",
                            "stdlib") and self.paths):
      raise ConfigError(
          f"data.paths: source={self.source!r} reads no files, got paths={self.paths!r}"
      )
    if self.cache is not None and not self.is_token_source:
      raise ConfigError(f"data.cache: source={self.source!r} has no tokens to cache")
    if self.cache is not None and self.is_chat:
      raise ConfigError(f"data.cache: source={self.source!r} is rendered and packed in memory; "
                        "leave data.cache unset")
    if self.max_bad_lines < 0:
      raise ConfigError(f"data.max_bad_lines must be >= 0, got {self.max_bad_lines}")
    if self.cache is not None and not self.cache.strip():
      raise ConfigError("data.cache must be a directory or a kvstore URL, got ''")
    if self.mixture is not None and (self.paths or self.cache or self.source != "stdlib"):
      raise ConfigError("data.mixture: its components name the corpora; leave data.source, "
                        "data.paths and data.cache unset")
    if self.tokenizer != "byte" and not self.tokenizer_path:
      raise ConfigError(f"data.tokenizer_path: tokenizer={self.tokenizer!r} needs a file")

  def batch_sizes(self) -> list[tuple[str, int]]:
    """(field, global rows) of each batch size a run reads: what must divide by the
    processes and by the mesh's data-parallel ways."""
    return [("data.batch_size", self.batch_size)] + [
        (f"data.batch_schedule[{i}].batch_size", stage.batch_size)
        for i, stage in enumerate(self.batch_schedule)]

  def component(self, name: str) -> DataConfig:
    """A mixture component's corpus as a config of its own (this one's tokenizer,
    lengths, batch and split)."""
    c = self.mixture.components[name]
    return dataclasses.replace(
        self, source=c.source, paths=c.paths, text_column=c.text_column, cache=c.cache,
        max_documents=self.max_documents if c.max_documents is None else c.max_documents,
        mixture=None)

  @property
  def holdout_fraction(self) -> float:
    """`validation_fraction` with its per-source default filled in."""
    if self.validation_fraction is not None:
      return self.validation_fraction
    return 0.05 if self.is_token_source else 0.2

  @property
  def is_token_source(self) -> bool:
    """True for the text and token sources; False for `digits` (images and labels) and
    `custom` (your Task's batches)."""
    return self.source in TOKEN_SOURCES or self.is_chat

  @property
  def is_chat(self) -> bool:
    """True for conversations rendered with a chat template (chat and preference sources)."""
    return self.source in (*CHAT_SOURCES, *PREFERENCE_SOURCES)

  @property
  def is_preference(self) -> bool:
    """True for preference pairs (`preference`, `preference_stdlib`): DPO's data."""
    return self.source in PREFERENCE_SOURCES

  @property
  def is_prompts(self) -> bool:
    """True for prompts a policy answers (`prompts`, `prompts_arithmetic`): RL's data."""
    return self.source in PROMPT_SOURCES


def require_token_source(config: DataConfig, what: str) -> None:
  """Raises `ConfigError` when `what` (a corpus, a vocabulary) is asked of an image set."""
  if not config.is_token_source:
    kind = "a labelled image set" if config.source == "digits" else "your Task's own batches"
    raise ConfigError(
        f"data.source={config.source!r} is {kind}, not text or tokens: it has"
        f" no {what}; use one of {', '.join(TOKEN_SOURCES)}"
    )
