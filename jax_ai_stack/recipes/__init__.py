"""Recipe builders: each returns the library's own object (an `nnx.Module`, an
`optax.GradientTransformation`, a Grain dataset, an Orbax `CheckpointManager`).

Submodules load on first use, so `from jax_ai_stack import recipes` stays cheap.
Fine-tuning and quantization (LoRA, QLoRA, QAT, PTQ) live in `finetune`.

Example:
  >>> from jax_ai_stack import recipes
  >>> recipes.config.DEFAULT_PRESET, recipes.finetune.config.SCHEMES["w8"]
  ('lm-tiny', 'int8 weights')
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = (
    "aot", "byte_sizes", "checkpoint", "checkpoint_config", "cli", "compile_cache", "config",
    "configlib", "data", "distributed", "evaluation", "finetune", "generate_cli", "held_out",
    "hf_cli", "host_memory", "inference", "measured_activations", "memory",
    "mesh_axes", "metrics", "models", "opening", "optim", "optim_config", "phases", "preflight",
    "profile", "progress", "record", "rl", "run", "sample_memory", "serve", "sharding",
    "sharding_config", "step",
    "stop_signal", "tasks", "train", "trainer", "transforms", "workdir",
)
# Top-level modules until fine-tuning became a package (0.1.x): notebooks written
# then (`from jax_ai_stack.recipes import lora`) still run, with a DeprecationWarning.
# Remove at 0.2.
_MOVED = {"lora": "finetune.lora", "ptq": "finetune.ptq", "quant": "finetune.quant"}
__all__ = list(_SUBMODULES)
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, moved=_MOVED)
