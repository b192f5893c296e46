"""transformers' side of `engine.py --transformers`, in a process of its own.

So that PyTorch's threads never share a process with JAX's (see torch_process.py), the
parent exports its model (`models.hf.save`) and writes the requests to a directory,
then runs `python hf_generate.py DIR` with an interpreter that has torch and
transformers (`--torch-python`). This loads the export with `AutoModelForCausalLM`,
float32 on the CPU, and times greedy `generate` two ways, each after a warm-up on the
first requests:

  per request   one `generate` per request, as the loop does
  batched       `batch` requests at a time, left-padded with an attention mask, each
                batch to its longest output, cut per request afterwards

and prints one JSON object: the versions, the seconds of each, and each one's tokens.
`requests.json`: {"batch": n, "requests": [{"prompt": [ids], "max_tokens": n}, ...]}.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time


def main(directory: str) -> dict:
  import torch
  import transformers

  spec = json.loads((pathlib.Path(directory) / "requests.json").read_text())
  requests, batch = spec["requests"], spec["batch"]
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  model.eval()
  pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

  def generate(rows: list[dict]) -> list[list[int]]:
    width = max(len(r["prompt"]) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in rows])
    mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"])
                         for r in rows])
    longest = max(r["max_tokens"] for r in rows)
    with torch.no_grad():  # No EOS: every request runs to its max_tokens, as the engine's.
      out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, eos_token_id=None, pad_token_id=pad)
    return [out[i, width:width + r["max_tokens"]].tolist() for i, r in enumerate(rows)]

  variants = {"per request": lambda: [generate([r])[0] for r in requests],
              "batched": lambda: [tokens for start in range(0, len(requests), batch)
                                  for tokens in generate(requests[start:start + batch])]}
  record = {"transformers": transformers.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "seconds": {}, "tokens": {}}
  generate(requests[:2])  # Warm-up: the first call sets up what later ones reuse.
  for name, call in variants.items():
    started = time.perf_counter()
    record["tokens"][name] = call()
    record["seconds"][name] = time.perf_counter() - started
  return record


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
