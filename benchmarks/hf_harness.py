"""The harness's `hf` backend's side of `harness.py --hf-backend`, in a process of its own.

So that PyTorch's threads never share a process with JAX's (see torch_process.py), the
parent exports its model (`models.hf.save`) and writes the requests to a directory, then
runs `python hf_harness.py DIR` with an interpreter that has torch, transformers and
lm-eval (`--torch-python`). This loads the export into lm-eval's `HFLM` (float32, the
CPU, `batch` rows at a time, the reference script's stand-in tokenizer: the requests are
token ids) and times `_loglikelihood_tokens`, what the harness's `loglikelihood` calls,
after a warm-up on the first requests. Prints one JSON object: the versions, the seconds
and each request's (log-likelihood, is-greedy).
`requests.json`: {"batch": n, "requests": [[context ids, continuation ids], ...]}.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(directory: str) -> dict:
  import lm_eval
  import torch
  import transformers
  from lm_eval.models.huggingface import HFLM

  sys.path.insert(0, str(ROOT / "scripts"))
  from make_harness_references import stand_in_tokenizer

  spec = json.loads((pathlib.Path(directory) / "requests.json").read_text())
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  harness = HFLM(pretrained=model.eval(), tokenizer=stand_in_tokenizer(model.config.vocab_size),
                 batch_size=spec["batch"])
  asked = [(("", ""), context, continuation) for context, continuation in spec["requests"]]
  harness._loglikelihood_tokens(asked[:spec["batch"]], disable_tqdm=True)  # Warm-up.
  started = time.perf_counter()
  scores = harness._loglikelihood_tokens(asked, disable_tqdm=True)
  seconds = time.perf_counter() - started
  return {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
          "torch": torch.__version__, "seconds": seconds,
          "scores": [[float(logp), bool(greedy)] for logp, greedy in scores]}


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
