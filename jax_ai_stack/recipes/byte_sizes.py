"""Sizes of memory as people write them (`--device-memory 16GiB`, `--max-shard-size 2GB`)
and as the memory plan prints them.

Example:
  >>> parse_bytes("16GiB") == 16 * 2**30, format_bytes(3 * 2**29)
  (True, '1.50 GiB')
"""

from __future__ import annotations

import re

import pydantic

from jax_ai_stack.errors import UsageError

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
"""What `parse_bytes` accepts: stricter than `pydantic.ByteSize` alone, which reads
"1,5GB" as 1 byte and ignores what follows a unit ("16GB!")."""
_BYTE_SIZE = pydantic.TypeAdapter(pydantic.ByteSize)


def parse_bytes(text: str) -> int:
  """'16GiB' -> 17179869184; also GB (powers of 10), MiB, KiB, plain bytes.

  Raises:
    UsageError: not a size.
  """
  match = _SIZE.fullmatch(text)
  try:
    if match:  # "16Gi" too, which ByteSize reads only as "16GiB".
      return int(_BYTE_SIZE.validate_python(f"{match[1]}{match[2] or ''}B"))
  except pydantic.ValidationError:  # Too large for a float.
    pass
  raise UsageError(f"--device-memory {text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB")


def format_bytes(n: int) -> str:
  """Bytes in binary units with three significant digits: '1.50 GiB', '512 MiB' ('1010 KiB', not
  '1.01e+03 KiB', just under a MiB)."""
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.0f} {unit}" if n / size >= 100 else f"{n / size:.2f} {unit}"
  return f"{n} B"
