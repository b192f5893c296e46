"""A tokenized corpus on disk: tokenized once with TensorStore, read per batch.

Re-reading and re-tokenizing a large corpus at every start costs minutes and
holds every token in memory. `prepare(config, location)` tokenizes `data`'s
source once into a cache; `TokenCache.open` checks that a cache fits a config
and reads token slices (only the chunks they touch); `load_cached_corpus`
turns it into the same train/validation `TokenCorpus` pair as the in-memory
path, whose `tokens` read from the cache. Windows, packing, the split and the
order then run the same code, so batches are bitwise those of the in-memory
path while memory holds only the document offsets.

Layout (zarr v3 arrays; chunks zstd-compressed with a crc32c checksum; a chunk
file of `tokens` holds blocks of `read_block_tokens` compressed one by one):

  tokens/          uint16 or int32 [num_tokens]: every document's ids, back to back
  doc_offsets/     int64 [num_documents + 1]: document d is tokens[o[d]:o[d + 1]]
  doc_digests/     uint8 [num_documents, 16]: the hash each document's chunks are
                   split by (`corpus.document_digest`), so one cache serves any
                   `validation_fraction` and `split_chunk_tokens`
  identity.json    what the cache is of (tokenizer, source files, settings, layout)
  shards/NNNNN.json  one per committed shard of documents: its document and token range
  manifest.json    identity plus counts; written last, so its presence means complete

Crash safety: a shard's chunks are written first, then its ledger file
`shards/NNNNN.json` atomically; only then is the shard committed. A rerun
continues after the last committed shard and rewrites whatever a killed run
had written beyond it with the same bytes (a chunk's bytes depend on its
contents alone), so it ends byte-identical to an uninterrupted run.

Workers: with `workers=N` (`data prepare --workers N`) this process reads
the documents and N spawned processes tokenize them, a shard per task; shards
are written strictly in order, so the cache is byte-identical to one of a
single process, and at most 2N shards are in flight, so memory stays bounded.

`location` is a directory or a TensorStore kvstore URL (`file://`,
`memory://`, ...). Local files are replaced with `atomic.write_atomically`;
other kvstores write each key atomically themselves.

Modules: `store` (where a cache lives: the location, its JSON files and
arrays), `identity` (what a cache is of, the manifest, refusing another
corpus), `workers` (tokenizing shards, in spawned processes with `workers=N`),
`writer` (`prepare`: shards appended and committed) and `reader`
(`TokenCache`, `load_cached_corpus`). The names below load from them on first
use, so importing the package pays for no TensorStore.

Example: two text files tokenized (byte tokenizer: BOS 256, EOS 257) into a cache.
  >>> import dataclasses
  >>> from jax_ai_stack.recipes.data import DataConfig, token_cache
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> config = DataConfig(source="text", paths=("*.txt",))
  >>> token_cache.prepare(config, "cache", progress=False).num_tokens
  12
  >>> cache = token_cache.TokenCache.open("cache", config)
  >>> cache.doc_offsets().tolist(), cache.read(0, 5).tolist()
  ([0, 5, 12], [256, 97, 98, 99, 257])
  >>> corpora = token_cache.load_cached_corpus(dataclasses.replace(config, cache="cache"))
  >>> corpora["train"].num_tokens + corpora["validation"].num_tokens
  12
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("identity", "reader", "store", "workers", "writer")
_EXPORTS = {
    "FORMAT_VERSION": "identity", "IDENTITY": "identity", "MANIFEST": "identity",
    "Manifest": "identity", "CachedTokens": "reader", "TokenCache": "reader",
    "load_cached_corpus": "reader", "split_corpora": "reader",
    "DEFAULT_CHUNK_TOKENS": "store", "READ_BLOCK_TOKENS": "store",
    "DEFAULT_SHARD_DOCUMENTS": "writer", "prepare": "writer",
}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
