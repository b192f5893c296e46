"""absl flags are marked parsed without reading the user's command line."""

import subprocess
import sys


def test_tokamax_runs_under_a_foreign_command_line():
  code = (
      "import sys; sys.argv = ['prog', '--model.num_layers', '2', '-q'];"
      "from jax_ai_stack.absl_flags import ensure_absl_flags_parsed; ensure_absl_flags_parsed();"
      "import jax.numpy as jnp, tokamax;"
      "x = jnp.ones((1, 8, 2, 8));"
      "print(tokamax.dot_product_attention(x, x, x, implementation='xla').shape)"
  )
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "(1, 8, 2, 8)" in result.stdout
