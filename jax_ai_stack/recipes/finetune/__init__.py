"""Fine-tuning and quantization of trained runs: LoRA, QLoRA, QAT and PTQ through Qwix.

A recipe's `finetune` section starts a run from a trained one (every parameter,
or low-rank adapters on a frozen, optionally quantized base); its `quant`
section trains through Qwix's fake quantization (QAT); `jax-ai-stack quantize`
converts a finished run (PTQ).

Modules:
  config      the `finetune` and `quant` sections and the scheme names (no jax)
  quant       Qwix rules of each scheme for the recipe models; `qat` and `ptq` of a model
  lora        the fine-tuning transform: what trains, what is saved, the reference
  adapters    Qwix LoRA adapters: added, read, switched off, merged into a plain model
  base_run    the trained run a fine-tune starts from: read, checked, quantized (QLoRA)
  reference   a frozen copy of the base: DPO's reference in full fine-tuning
  transforms  the model transforms a recipe asks for (what `Task.model_transforms` gives)
  lora_merge  `merge`: a LoRA run's adapters folded into a plain run
  ptq         quantize a finished run, compare it with float, save it, serve it
  lora_cli    `jax-ai-stack lora merge`
  quant_cli   `jax-ai-stack quantize`

Names load on first use, so a recipe config reads `LoraConfig` without jax.

Example:
  >>> from jax_ai_stack.recipes import finetune
  >>> finetune.LoraConfig(rank=4).alpha, sorted(finetune.SCHEMES)
  (8.0, ['w4', 'w8', 'w8a8'])
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("adapters", "base_run", "config", "lora", "lora_cli", "lora_merge", "ptq", "quant",
               "quant_cli", "reference", "teacher", "transforms")
_EXPORTS = {
    "FinetuneConfig": "config",
    "LoraConfig": "config",
    "QuantConfig": "config",
    "SCHEMES": "config",
    "SchemeError": "config",
    "check_scheme": "config",
    "BaseCheckpointError": "base_run",
    "Finetune": "lora",
    "merged_model": "adapters",
    "open_quantized": "ptq",
    "quantize_run": "ptq",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
