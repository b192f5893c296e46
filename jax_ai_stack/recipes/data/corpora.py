"""`load_corpus`: a config's train and validation tokens, from memory or the token cache.

Above both places tokens can live: `corpus` (tokenized at start, held in
memory) and `token_cache` (tokenized once into TensorStore, read per batch),
which builds on `corpus`'s tokenization and split.

Example:
  >>> from jax_ai_stack.recipes.data.config import DataConfig
  >>> splits = load_corpus(DataConfig(max_documents=2, validation_fraction=0.5))
  >>> sorted(splits), splits["train"].tokens.dtype.name
  (['train', 'validation'], 'uint16')
"""

from __future__ import annotations

from jax_ai_stack.recipes.data.config import DataConfig
from jax_ai_stack.recipes.data.corpus import Split, TokenCorpus, load_in_memory
from jax_ai_stack.recipes.data.token_cache.reader import load_cached_corpus

__all__ = ["load_corpus"]


def load_corpus(config: DataConfig) -> dict[Split, TokenCorpus]:
  """`{"train": TokenCorpus, "validation": TokenCorpus}` for a token source.

  With `data.cache` set, the tokens are read from that TensorStore cache
  (prepared first when it does not exist) instead of held in memory.

  Raises:
    DataError: the corpus is empty, or a file holds bad data (names the file),
      or `data.cache` does not fit the config (names what differs);
      a path, glob or tokenizer file that matches nothing is also a
      FileNotFoundError.
    ConfigError: the source is an image set.
  """
  if config.cache:  # The on-disk cache: tokens stay there and are read per batch.
    return load_cached_corpus(config)
  return load_in_memory(config)
