"""grain and tokamax read their absl flags; the host's command line and parse state stay its own."""

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                        text=True, timeout=180, check=False)


def test_tokamax_runs_under_a_foreign_command_line():
  result = _run("""
      import sys; sys.argv = ['prog', '--model.num_layers', '2', '-q']
      from jax_ai_stack.kernels import implementations
      import jax.numpy as jnp
      tokamax = implementations.import_tokamax()
      x = jnp.ones((1, 8, 2, 8))
      print(tokamax.dot_product_attention(x, x, x, implementation='xla').shape)
      """)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "(1, 8, 2, 8)" in result.stdout


def test_tokamax_still_reads_its_own_flag_from_the_command_line():
  result = _run("""
      import sys
      sys.argv = ['prog', '-q', '--tokamax_autotuning_cache_miss_fallback=error']
      from jax_ai_stack.kernels import implementations
      implementations.import_tokamax()
      from tokamax._src import config
      print(config.autotuning_cache_miss_fallback.value)
      """)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["error"]


def test_grain_workers_start_and_the_parse_state_is_left_alone():
  # Nothing parsed: the host (a notebook, a script) may still parse its own flags later.
  result = _run("""
      import contextlib
      from absl import flags
      from jax_ai_stack.recipes.data import DataConfig, build_dataset
      if __name__ == "__main__":
        config = DataConfig(max_documents=40, seq_len=16, batch_size=4, num_workers=1)
        ds = build_dataset(config, split="train", seed=0, process_index=0, process_count=1)
        with contextlib.closing(iter(ds)) as iterator:
          print(next(iterator)["inputs"].shape, flags.FLAGS.is_parsed())
        flags.FLAGS(["prog", "--grain_py_debug_mode"])
        print(flags.FLAGS.grain_py_debug_mode)
      """)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == ["(4, 16) False", "True"]
