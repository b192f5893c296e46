"""Input pipelines on Grain: corpora, tokenizers, windows and packing, resumable iterators.

`build_dataset(config, split=..., seed=...)` returns a `grain.IterDataset` of
this process's batches; keep composing it with Grain's own API. Its iterator
saves and restores with `get_state`/`set_state` or, inside an Orbax
`CheckpointManager`, with `grain.checkpoint.CheckpointSave(it)` /
`grain.checkpoint.CheckpointRestore(it)`.

Modules, in the order data flows:
  config      `DataConfig`
  sources     the stdlib corpus, text, .npy, ArrayRecord, Parquet, digits
  tokenizers  byte (default), Hugging Face `tokenizers`, SentencePiece
  corpus      tokenize once, split train/validation by a hash of each chunk
  examples    windows, packing, digits: a whole batch per NumPy gather
  permutation the stateless per-epoch order: a Feistel permutation per index
  mixture     several corpora by stage weights: each row's corpus from (seed, row)
  pipeline    order (seed, epoch, index), per-process shards, workers, state
  grain_exit  the pipeline's iterators still open at exit, closed while Grain can
  token_cache the corpus tokenized once into TensorStore, read per batch (`data.cache`)
  corpora     `load_corpus`: from memory (corpus) or the token cache
  cli         `jax-ai-stack data prepare`

With `num_workers > 0` Grain starts worker processes with `spawn`: a script
must build and iterate the dataset under `if __name__ == "__main__":`.

Names load on first use, so a recipe config reads `DataConfig` without Grain.

Example:
  >>> from jax_ai_stack.recipes.data import DataConfig, build_dataset
  >>> config = DataConfig(max_documents=40, seq_len=16, batch_size=4)
  >>> ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  >>> batch = next(iter(ds))
  >>> {k: v.shape for k, v in batch.items()}["inputs"]
  (4, 16)
  >>> bool((batch["targets"][:, :-1] == batch["inputs"][:, 1:]).all())
  True
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("arithmetic", "batch_schedule", "chat", "chat_template", "cli", "config", "corpora",
               "corpus", "examples", "grain_exit", "made_tasks", "mixture", "permutation",
               "pipeline", "preference", "prompts", "reversal", "sources", "token_cache",
               "tokenizers")
_EXPORTS = {
    "BatchSchedule": "batch_schedule",
    "ChatRows": "chat",
    "ChatTemplate": "chat_template",
    "DataConfig": "config",
    "PreferenceRows": "preference",
    "PromptRows": "prompts",
    "MixtureConfig": "config",
    "MixtureRows": "mixture",
    "TokenCorpus": "corpus",
    "load_corpus": "corpora",
    "DigitsExamples": "examples",
    "LMPacked": "examples",
    "LMWindows": "examples",
    "epoch_permutation": "permutation",
    "permute": "permutation",
    "StepBatches": "pipeline",
    "MixtureBatches": "pipeline",
    "mixture_rows": "pipeline",
    "build_dataset": "pipeline",
    "validation_sets": "pipeline",
    "DataFileNotFoundError": "sources",
    "load_digits": "sources",
    "resolve_paths": "sources",
    "stdlib_files": "sources",
    "TokenCache": "token_cache",
    "ByteTokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers",
    "SentencePieceTokenizer": "tokenizers",
    "Tokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
    "vocab_size": "tokenizers",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
