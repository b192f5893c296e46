"""`jax-ai-stack generate`: a trained run's text on stdout, what it waits on and how fast it
went on stderr (the epilog says what its closing line counts).

Example:
  >>> generation_summary([100], [0.5], 2.0)
  'generated 100 tokens in 2.0 s: 50.0 tokens/s, first token after 0.50 s'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator

from jax_ai_stack import logs
from jax_ai_stack.errors import UsageError

GUESSES = 4
"""Tokens a step guesses with --draft and no --speculate K."""
EPILOG = """\
Stdout holds the text (or --input's JSON lines); stderr what it waits on and how fast
it went. A phase that lasts over 5 s says so (opening the run, tracing, lowering and
compiling each program, with its time and whether the compilation cache served it;
generating), and again every 15 s while it lasts. The last line sums up the run:

  generated 40 tokens in 3.2 s: 12.5 tokens/s, first token after 1.10 s

new tokens (an end-of-sequence token included), their rate over the whole decoding
(the prompts' prefill and any compile included: a second run, served by the
compilation cache, is faster), and the time to first token, from a request's
queueing in the generation engine to its first token. With --input or a --chat file,
the totals of every request, the time to first token their mean and their most:

  generated 512 tokens for 4 requests in 6.0 s: 85.3 tokens/s, first token after
  1.20 s (mean; at most 1.40 s)
"""


def register(subparsers) -> None:
  generate = subparsers.add_parser(
      "generate", help="sample text from a trained LM workdir",
      description="Continue a prompt with the language model trained in --workdir (read-only;\n"
      "the run's own attention kernels).",
      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  generate.add_argument("--workdir", required=True, help="a workdir `train` wrote")
  generate.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
  generate.add_argument("--max-new-tokens", type=int,
                        help="tokens to add, at least 1; fewer if the model's max_seq_len is "
                        "reached or it ends (default: 128, or as many as fit)")
  generate.add_argument("--ignore-eos", action="store_true",
                        help="continue a prompt past the model's end-of-sequence ids (its "
                        "generation config's eos_token_id, else the tokenizer's EOS), to "
                        "--max-new-tokens; chat replies still end at their end of turn")
  generate.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 picks the most likely token (default 0.8)")
  generate.add_argument("--seed", type=int,
                        help="the sampling seed: the same seed gives the same text (default: a "
                        "new one each call, printed so that it can be repeated)")
  generate.add_argument("--top-k", type=int, metavar="K",
                        help="sample among the K most likely tokens only (default: all)")
  generate.add_argument("--top-p", type=float, metavar="P",
                        help="sample among the likeliest tokens whose probabilities add up to P "
                        "(nucleus sampling, 0 < P <= 1; default: all)")
  generate.add_argument("--verbose", action="store_true",
                        help="show the libraries' log lines on the console too")
  generate.add_argument("--quantized", metavar="SCHEME",
                        help="run the parameters `quantize --scheme SCHEME` saved in --workdir")
  generate.add_argument("--chat", nargs="?", const="-", metavar="FILE.jsonl",
                        help="answer as the assistant: --prompt is a user turn, rendered with "
                        "the run's chat template, and only the reply is printed, up to its "
                        "end-of-turn token; with a JSONL file, one reply per line (each a "
                        "conversation ending with a user turn, or {\"prompt\"})")
  generate.add_argument("--input", metavar="FILE.jsonl",
                        help="one request per line, {\"prompt\": TEXT} (continued) or "
                        "{\"messages\": [...]} (answered as the assistant), each with an "
                        "optional \"stop\" (strings that end it) and \"response_format\" "
                        "(OpenAI's: JSON that follows a schema), decoded together; "
                        "one JSON line per result on stdout as each finishes: {index, text, "
                        "finish_reason, tokens}")
  generate.add_argument("--speculate", type=int, metavar="K",
                        help="speculative decoding: each step also checks up to K tokens "
                        "guessed from the text so far (prompt lookup), keeping those the "
                        "model would have sampled: the same text, faster where it repeats "
                        "its prompt (code edited, a document quoted); the summary gives "
                        "the share kept")
  generate.add_argument("--draft", metavar="WORKDIR",
                        help="speculative decoding with a draft model: a smaller trained run "
                        "of the same tokenizer guesses the tokens (greedy), with --speculate "
                        f"K of them a step (default {GUESSES})")
  generate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  """`jax-ai-stack generate`: the run's text on stdout; the summary last on stderr."""
  from jax_ai_stack.recipes.cli import _check_quantized, _open_finished

  if args.top_p is not None and not 0 < args.top_p <= 1:
    raise UsageError(f"--top-p must be in (0, 1]; got {args.top_p}")
  if args.top_k is not None and args.top_k < 1:
    raise UsageError(f"--top-k must be at least 1; got {args.top_k}")
  if args.max_new_tokens is not None and args.max_new_tokens < 1:
    raise UsageError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
  if args.speculate is not None and args.speculate < 1:
    raise UsageError(f"--speculate must be at least 1 (tokens guessed a step); got "
                     f"{args.speculate}")
  _check_quantized(args)
  seed = args.seed
  if seed is None and args.temperature > 0:  # Each call a new sample, as users expect.
    seed = secrets.randbelow(2**31)
  logs.status(f"generating from {args.workdir} ...")
  from jax_ai_stack.recipes import compile_cache, progress

  compile_cache.enable()  # "auto": JAX_ENABLE_COMPILATION_CACHE=false turns it off.

  if args.input and args.chat:
    raise UsageError("--input and --chat both name what to answer: give one")
  from jax_ai_stack.recipes.inference import request_file

  if args.chat:
    items = [{"messages": messages}
             for messages in request_file.conversations(args.chat, args.prompt)]
  else:
    items = request_file.read(args.input) if args.input else [{"prompt": args.prompt}]
  # Each long trace and compile says so as it goes; quick ones stay silent.
  compile_times = compile_cache.CompileTimes(announce=progress.Wait).start()
  try:
    with progress.waiting("opening the run"):
      trainer = _open_finished(args, validation=False, method="decode")
    try:
      summary = _generate(trainer, args, items, seed)
    finally:
      trainer.close()
  finally:
    compile_times.stop()
  if args.seed is None and seed is not None:
    print(f"(seed {seed}: --seed {seed} gives this text again)", file=sys.stderr)
  print(summary, file=sys.stderr, flush=True)
  return 0


def _generate(trainer, args: argparse.Namespace, items: list[dict], seed: int | None) -> str:
  """Decodes `items` together and prints them as `generate` does (--input: a JSON line as
  each finishes; else the texts in order); returns the summary line."""
  from jax_ai_stack.recipes import progress

  sampling = dict(seed=seed, top_k=args.top_k, top_p=args.top_p)
  done = []
  with speculation(args, trainer.config) as sampling["speculation"], progress.waiting(
      "generating"):
    started = time.perf_counter()
    for result in trainer.stream(items, args.max_new_tokens, args.temperature,
                                 ignore_eos=args.ignore_eos, **sampling):
      done.append(result)
      if args.input:
        shown = {k: v for k, v in result.items()  # Stdout: the same bits, any speed.
                 if k not in ("first_token_s", "drafted", "accepted")}
        print(json.dumps(shown), flush=True)
        logs.status(f"{len(done)}/{len(items)} done")
  elapsed = time.perf_counter() - started
  if not args.input:  # One text per item, in order (a chat: the replies alone).
    for result in sorted(done, key=lambda r: r["index"]):
      print(result["text"], flush=True)
  guessed = ({"drafted": sum(r["drafted"] for r in done),
              "accepted": sum(r["accepted"] for r in done)} if sampling["speculation"] else {})
  return generation_summary([r["tokens"] for r in done], [r["first_token_s"] for r in done],
                            elapsed, **guessed)


@contextlib.contextmanager
def speculation(args: argparse.Namespace, config) -> Iterator:
  """The `inference.Speculation` that --speculate K and --draft WORKDIR ask of a run of
  `config` (None: neither), the draft's run open while it is used; UsageError in one line
  where the model, or the draft, cannot."""
  if not (args.speculate or args.draft):
    yield None
    return
  from jax_ai_stack.recipes import inference
  from jax_ai_stack.recipes.finetune.teacher import tokens_of
  from jax_ai_stack.recipes.run import build_run

  check_speculation(config.model, "--speculate")
  tokens = args.speculate or GUESSES
  if args.draft is None:
    yield inference.Speculation(tokens=tokens)
    return
  draft = build_run(None, args.draft, mode="read", validation=False, environ=os.environ,
                    capture_stderr=True)
  try:
    speaks = lambda c: tokens_of(c.data.tokenizer, c.data.tokenizer_path,  # noqa: E731
                                 c.model.vocab_size)
    theirs, ours = speaks(draft.config), speaks(config)
    if theirs != ours:
      other = " (another file)" if theirs[1] != ours[1] else ""
      raise UsageError(f"--draft {args.draft}: tokenizer {theirs[0]}{other}, vocab_size "
                       f"{theirs[2]}; the run it drafts for: tokenizer {ours[0]}, vocab_size "
                       f"{ours[2]}: a draft model needs the same tokenizer and vocabulary")
    check_speculation(draft.config.model, "--draft")
    yield inference.Speculation(tokens=tokens, draft=draft.inference_model())
  finally:
    draft.close()


def check_speculation(model_config, flag: str) -> None:
  """UsageError where the model cannot speculate (`inference.speculation`): a layer that
  keeps a state per slot (linear attention's) would have taken in the refused guesses."""
  if model_config.linear_attention is not None:
    raise UsageError(f"{flag}: model.kind={model_config.kind!r} has linear-attention layers, "
                     "whose state per request would take in the guesses the model refuses; "
                     "decode it without speculation")


def generation_summary(tokens: list[int], first_token_s: list[float], elapsed_s: float,
                       drafted: int | None = None, accepted: int = 0) -> str:
  """`generate`'s last line on stderr: the new tokens of every request, their rate over the
  whole decoding (prefill and any compile included), and the time to first token (from
  a request's queueing in the engine; with several requests, the mean and the most); with
  speculation, the guessed tokens (`drafted`) and the share the model kept.

  Example:
    >>> generation_summary([100], [0.5], 2.0)
    'generated 100 tokens in 2.0 s: 50.0 tokens/s, first token after 0.50 s'
    >>> generation_summary([60, 40], [0.5, 1.5], 4.0)
    'generated 100 tokens for 2 requests in 4.0 s: 25.0 tokens/s, first token after 1.00 s (mean; at most 1.50 s)'
    >>> generation_summary([100], [0.5], 2.0, drafted=80, accepted=60)
    'generated 100 tokens in 2.0 s: 50.0 tokens/s, first token after 0.50 s; 60 of 80 guessed tokens kept (75%)'
  """
  total = sum(tokens)
  requests = f" for {len(tokens)} requests" if len(tokens) != 1 else ""
  first = sum(first_token_s) / max(len(first_token_s), 1)
  spread = f" (mean; at most {max(first_token_s):.2f} s)" if len(first_token_s) > 1 else ""
  guesses = ("" if drafted is None else f"; {accepted} of {drafted} guessed tokens kept "
             f"({accepted / max(drafted, 1):.0%})")
  return (f"generated {total} tokens{requests} in {elapsed_s:.1f} s: "
          f"{total / max(elapsed_s, 1e-9):.1f} tokens/s, first token after {first:.2f} s"
          f"{spread}{guesses}")
