"""`jax-ai-stack import-hf` and `export-hf`: Hugging Face model directories <-> workdirs.

    jax-ai-stack import-hf DIR --workdir W [--preset P] [--config FILE] [dotted overrides]
    jax-ai-stack train --config W/config.yaml --workdir W train.steps=N   (fine-tune it)
    jax-ai-stack eval --workdir W;  jax-ai-stack generate --workdir W --prompt TEXT
    jax-ai-stack export-hf --workdir W OUT [--max-shard-size 5GB]

`import-hf` writes step 0 of a run, exactly as `train` saves one (state,
data position, metadata with the recipe config), whose model section comes
from DIR/config.json and whose parameters from DIR's safetensors. The rest
of the recipe is the preset's (default lm-tiny), then --config, then the
overrides (e.g. `data.source=text data.paths=[corpus.txt]`, `model.param_dtype=float32`).
A DIR/tokenizer.json is copied into W and becomes the run's tokenizer, with its
chat template (DIR/tokenizer_config.json, DIR/chat_template.jinja) where it has one, and
config.json's special-token ids and DIR/generation_config.json, which `export-hf` writes
back unchanged (`hf.special_tokens`). The
resolved config is written to W/config.yaml, for `train --config` to continue
from step 0.

Nothing is written when the input is bad: config.json, the tensors' names and
shapes and the tokenizer are checked before W is created, and W is removed
again if anything fails later. `export-hf` writes OUT beside itself and
renames it into place. In a notebook, `import_hf(DIR, W, overrides=[...])` and
`export_hf(W, OUT)` do the same.

Example: the recipe `import-hf` builds from a config.json and the command line.
  >>> import json, os
  >>> from jax_ai_stack.recipes.models import hf
  >>> os.mkdir("tiny-llama")
  >>> _ = open("tiny-llama/config.json", "w").write(json.dumps({
  ...     "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
  ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
  >>> config = import_config("tiny-llama", hf.read_config("tiny-llama"), tokenizer=None,
  ...                        overrides=["train.steps=10"])
  >>> config.name, config.model.num_layers, config.model.d_model, config.train.steps
  ('hf-tiny-llama', 2, 64, 10)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
from collections.abc import Mapping, Sequence

from jax_ai_stack import logs
from jax_ai_stack.errors import ModelFileError, UsageError, WorkdirError


def register(subparsers) -> None:
  importer = subparsers.add_parser(
      "import-hf", help="import a Hugging Face model directory as a run's step 0",
      description="Read DIR (config.json, model.safetensors or its shards, optional "
      "tokenizer.json) into a new workdir, as step 0 of a run that train, eval and generate "
      "use. Extra arguments are dotted config overrides.")
  importer.add_argument("directory", metavar="DIR", help="a Hugging Face model directory")
  importer.add_argument("--workdir", required=True, help="the new workdir (missing or empty)")
  importer.add_argument("--preset", help="the preset the rest of the recipe comes from "
                        "(default lm-tiny)")
  importer.add_argument("--config", help="a YAML file merged over the preset")
  importer.set_defaults(func=run_import, accepts_overrides=True)

  exporter = subparsers.add_parser(
      "export-hf", help="write a run's model as a Hugging Face model directory",
      description="Write the newest checkpoint of --workdir as OUT/config.json and "
      "safetensors (sharded above --max-shard-size), plus the run's tokenizer.json if it has one.")
  exporter.add_argument("out", metavar="OUT", help="the directory to write (missing or empty)")
  exporter.add_argument("--workdir", required=True, help="a workdir train or import-hf wrote")
  exporter.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB or 500MiB (default 5GB)")
  exporter.set_defaults(func=run_export)


def _empty_or_missing(path: pathlib.Path, what: str) -> None:
  if path.exists() and not (path.is_dir() and not any(path.iterdir())):
    raise WorkdirError(f"{what} {path} already exists and is not empty; choose a new one")


def import_config(directory: str | os.PathLike, model_fields: dict,
                  tokenizer: pathlib.Path | None, *, preset: str | None = None,
                  config_file: str | os.PathLike | None = None, overrides: Sequence[str] = ()):
  """The recipe: preset and config file, the model from config.json, the tokenizer, overrides."""
  from jax_ai_stack.recipes import config as recipe_config
  from jax_ai_stack.recipes import configlib

  base = configlib.to_dict(recipe_config.load(preset, config_file=config_file))
  base["model"] = dict(model_fields)
  base["name"] = f"hf-{pathlib.Path(directory).absolute().name}"
  if tokenizer is not None:
    base["data"] = {**base["data"], "tokenizer": "huggingface", "tokenizer_path": str(tokenizer)}
  data = configlib.apply_overrides(base, configlib.parse_overrides(list(overrides)))
  return configlib.from_dict(recipe_config.RecipeConfig, data,
                             source=f"{directory}/config.json + overrides")


def import_hf(directory: str | os.PathLike, workdir: str | os.PathLike, *,
              preset: str | None = None, config_file: str | os.PathLike | None = None,
              overrides: Sequence[str] = (), environ: Mapping[str, str] | None = None):
  """`jax-ai-stack import-hf`: DIR's model as step 0 of a run in a new `workdir`.

  Returns the run's `RecipeConfig` (also written to `workdir/config.yaml`);
  `finetune.base=<workdir>` fine-tunes it, `train --config` continues it.
  """
  from jax_ai_stack.recipes.data import tokenizers
  from jax_ai_stack.recipes.models import hf
  from jax_ai_stack.recipes.models.hf import special_tokens
  from jax_ai_stack.recipes.run import build_run
  from jax_ai_stack.recipes.workdir import write_config

  source = pathlib.Path(directory)
  workdir = pathlib.Path(workdir).absolute()
  fields = hf.read_config(source)
  _empty_or_missing(workdir, "workdir")
  tokenizer = source / hf.TOKENIZER_FILE
  tokenizer = tokenizer if tokenizer.is_file() else None
  config = import_config(source, fields, workdir / hf.TOKENIZER_FILE if tokenizer else None,
                         preset=preset, config_file=config_file, overrides=overrides)
  if getattr(config, "finetune", None) is not None and config.finetune.active:
    raise UsageError("import-hf starts a run from DIR's weights, not from finetune.base: leave "
                     "finetune unset here, then fine-tune with finetune.base=<the new workdir>")
  copied = tokenizer is not None and config.data.tokenizer_path == str(workdir / hf.TOKENIZER_FILE)
  # Unreadable or with ids the model cannot embed: refused before anything is written.
  padding = _check_tokenizer(tokenizers.HuggingFaceTokenizer(str(tokenizer)) if copied
                             else tokenizers.build_tokenizer(config.data),
                             config.model.vocab_size, tokenizer if copied else None, source)
  stored = hf.check_weights(source, config.model)  # Names, shapes, headers: before W exists.
  if padding:  # Said once every check passed: a refusal stays its one line.
    logs.note(padding)
  if unread := hf.unread_layers(stored, config.model):
    logs.note(f"{source}: {len(unread)} tensors of multi-token prediction layers (from "
              f"{unread[0]!r}) are not read: the model predicts the next token only")
  created = not workdir.exists()
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    if copied:
      hf.copy_tokenizer(tokenizer, workdir)  # With its chat template, where it has one.
      special_tokens.keep(source, workdir)  # config.json's token ids, generation_config.json.
    write_config(workdir, config)
    run = build_run(config, workdir, mode="train", resume="never",
                    environ=os.environ if environ is None else environ,
                    initial_params=lambda target: hf.load_params(source, config.model, target))
    try:
      run.save(force=True)
    finally:
      run.close()
  except BaseException:
    if created:
      shutil.rmtree(workdir, ignore_errors=True)
    else:  # It was empty: empty it again.
      for entry in workdir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    raise
  return config


def run_import(args: argparse.Namespace) -> int:
  logs.status(f"importing {args.directory} into {args.workdir} ...")
  from jax_ai_stack.recipes.run import vocabulary_padding
  from jax_ai_stack.recipes.workdir import CONFIG_FILE

  config = import_hf(args.directory, args.workdir, preset=args.preset, config_file=args.config,
                     overrides=args.overrides)
  workdir = pathlib.Path(args.workdir).absolute()
  print(f"imported {args.directory} into {workdir} as step 0: {config.model.num_params():,} "
        f"parameters{vocabulary_padding(config.model)}.\nfine-tune: jax-ai-stack train "
        f"--config {workdir / CONFIG_FILE} --workdir {workdir} train.steps=N")
  return 0


def _check_tokenizer(tokenizer, vocab_size: int, file: pathlib.Path | None,
                     source: pathlib.Path) -> str | None:
  """Refuses a tokenizer with more ids than the model has rows (`check_data`, before
  writing); the note to say where the model has rows no token of it reaches, else None.

  A tokenizer.json without BOS or PAD reuses its EOS (`data.tokenizers`); one
  with no EOS of a known name gets the missing ids appended after its
  vocabulary, which a model of exactly that many rows cannot embed; the
  message says which. Rows beyond the tokenizer (Qwen's 151,936 over its
  151,669 ids) are padding: the model never reads them, and an id it generates
  there decodes to no text, so a tokenizer far smaller than the model (one from
  another model) is worth a word.
  """
  what = f"{file}" if file else f"the run's {type(tokenizer).__name__}"
  where = f" ({source} has no tokenizer.json)" if not file else ""
  rows = f"{source / 'config.json'} has vocab_size={vocab_size}"
  if tokenizer.vocab_size < vocab_size:
    return (f"{what}{where} has {tokenizer.vocab_size:,} ids and {rows}: the model's "
            f"{vocab_size - tokenizer.vocab_size:,} rows beyond them are only padding (an id "
            "generated there decodes to no text)")
  if tokenizer.vocab_size == vocab_size:
    return None
  appended = [name for name, i in zip(("BOS", "EOS", "PAD"), tokenizer.special_ids)
              if i >= vocab_size]
  why = (f": it defines no {'/'.join(appended)} token of a known name, so the recipe's tokenizer "
         "appends one beyond the model's vocabulary" if file and appended else where)
  raise ModelFileError(f"{what} needs {tokenizer.vocab_size:,} ids but {rows}, which cannot "
                       f"embed ids {vocab_size:,} and up{why}")


def export_hf(workdir: str | os.PathLike, out: str | os.PathLike, *,
              max_shard_bytes: int | None = None,
              capture_stderr: bool = False) -> tuple[int, list[str]]:
  """`jax-ai-stack export-hf`: the newest checkpoint of `workdir` as a Hugging Face directory.

  Writes `out` (missing or empty): config.json in the model's own architecture,
  safetensors, and the run's tokenizer.json if it has one. Returns the step
  written and the files.
  """
  from jax_ai_stack.recipes.models import hf
  from jax_ai_stack.recipes.models.hf import families as hf_families, special_tokens
  from jax_ai_stack.recipes.run import build_run

  out = pathlib.Path(out)
  _empty_or_missing(out, "output directory")
  _refuse_quantized(pathlib.Path(workdir))
  trainer = build_run(None, workdir, mode="read", environ=os.environ,
                      capture_stderr=capture_stderr)
  try:
    if not hf.writes(trainer.model):
      raise UsageError(f"{workdir} trained a {trainer.config.model.kind} model; export-hf "
                       f"writes the decoder families ({', '.join(hf_families.KINDS)}) only")
    data = trainer.config.data
    tokenizer, token_ids, generation = None, {}, None
    if data.tokenizer == "huggingface":
      tok = trainer.task.tokenizer()
      tokenizer = data.tokenizer_path
      token_ids, generation = special_tokens.for_export(
          tokenizer, bos=tok.bos_id, eos=tok.eos_id, pad=tok.pad_id,
          end_of_turn=tok.end_of_turn_ids())
    if max_shard_bytes is None:
      max_shard_bytes = hf.DEFAULT_MAX_SHARD_BYTES
    model, notes = trainer.exported_model()
    for note in notes:
      logs.note(note)
    return trainer.step, hf.save(model, out, max_shard_bytes=max_shard_bytes,
                                 tokenizer=tokenizer, token_ids=token_ids,
                                 generation_config=generation)
  finally:
    trainer.close()


def _refuse_quantized(workdir: pathlib.Path) -> None:
  """A `jax-ai-stack quantize` result (<run>/quantized/<scheme>) holds int8/int4 values and
  scales, which no Hugging Face architecture of ours holds: the float run is what exports."""
  from jax_ai_stack.recipes.finetune.ptq import QUANTIZED_DIR
  from jax_ai_stack.recipes.workdir import CHECKPOINT_DIR

  run = workdir.parent.parent
  if workdir.parent.name == QUANTIZED_DIR and (run / CHECKPOINT_DIR).is_dir():
    raise UsageError(f"{workdir} holds Qwix-quantized weights ({workdir.name}: integer values "
                     "and scales), which a Hugging Face model directory of these architectures "
                     f"cannot hold; export the float run instead: jax-ai-stack export-hf "
                     f"--workdir {run} OUT")


def run_export(args: argparse.Namespace) -> int:
  logs.status(f"exporting {args.workdir} to {args.out} ...")
  from jax_ai_stack.recipes import memory

  try:
    max_bytes = memory.parse_bytes(args.max_shard_size)
  except UsageError:
    raise UsageError(f"--max-shard-size {args.max_shard_size!r} is not a size; "
                     "write e.g. 5GB or 500MiB") from None
  step, files = export_hf(args.workdir, args.out, max_shard_bytes=max_bytes,
                          capture_stderr=True)
  print(f"wrote step {step} of {args.workdir} to {args.out}: {', '.join(files)}")
  return 0
