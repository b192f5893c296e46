"""Progress bars: tqdm on a terminal, plain lines elsewhere."""

import io

from jax_ai_stack.recipes import progress


def test_lines_say_where_they_are_and_how_long_is_left():
  out = io.StringIO()
  lines = progress.Lines("step", total=600, initial=100, file=out)
  lines.update(50)
  lines.set_postfix_str("loss 1.900")
  assert out.getvalue().startswith("step 150/600: loss 1.900, ETA ")
  unknown = progress.Lines("doc", total=None, initial=0, file=out)
  unknown.update(8)
  unknown.set_postfix_str("1,000 tokens/s")
  assert out.getvalue().splitlines()[-1] == "doc 8: 1,000 tokens/s"  # No total: no ETA.


def test_off_a_terminal_the_bar_is_lines(capsys):
  bar = progress.bar("train", unit="step", total=4)  # pytest's stderr is no terminal.
  assert isinstance(bar, progress.Lines)
  bar.update(2)
  bar.set_postfix_str("loss 2.000")
  assert capsys.readouterr().err.startswith("step 2/4: loss 2.000, ETA ")
