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
  pipeline    order (seed, epoch, index), per-process shards, workers, state

With `num_workers > 0` Grain starts worker processes with `spawn`: a script
must build and iterate the dataset under `if __name__ == "__main__":`.

Example:
  >>> config = DataConfig(max_documents=40, seq_len=16, batch_size=4)
  >>> ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
  >>> batch = next(iter(ds))
  >>> {k: v.shape for k, v in batch.items()}["inputs"]
  (4, 16)
  >>> bool((batch["targets"][:, :-1] == batch["inputs"][:, 1:]).all())
  True
"""

from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.corpus import TokenCorpus, load_corpus
from jax_ai_stack.recipes.data.examples import DigitsExamples, LMPacked, LMWindows
from jax_ai_stack.recipes.data.permutation import epoch_permutation, permute
from jax_ai_stack.recipes.data.pipeline import StepBatches, build_dataset
from jax_ai_stack.recipes.data.sources import (
    DataFileNotFoundError,
    load_digits,
    resolve_paths,
    stdlib_files,
)
from jax_ai_stack.recipes.data.tokenizers import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    vocab_size,
)

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DataFileNotFoundError",
    "DigitsExamples",
    "HuggingFaceTokenizer",
    "LMPacked",
    "LMWindows",
    "SentencePieceTokenizer",
    "StepBatches",
    "TokenCorpus",
    "Tokenizer",
    "build_dataset",
    "build_tokenizer",
    "epoch_permutation",
    "load_corpus",
    "load_digits",
    "permute",
    "resolve_paths",
    "stdlib_files",
    "vocab_size",
]
