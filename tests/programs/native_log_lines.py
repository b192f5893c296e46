"""Native log lines and ours written to file descriptor 2: a fresh interpreter's stderr, read whole.

argv: the log file, on or off, a native warning line."""

import os
import pathlib
import sys
import time

from jax_ai_stack import logs, native_logs

warning = sys.argv[3].encode()
with logs.routed(pathlib.Path(sys.argv[1]), verbose=False) as routes:
  with native_logs.kept_off_console(enabled=sys.argv[2] == "on"):
    os.write(2, warning + b"\n  its second line\n")
    os.write(2, b"E1125 21:40:17.123456   4242 foo.cc:1] an error\n")
    sys.stderr.write("\rstep 1/2")
    sys.stderr.flush()
    print("\nours", file=sys.stderr)
    os.write(2, b"I1125 21:40:17.1")  # A log line written in two pieces.
    time.sleep(0.05)
    os.write(2, b"23456   4242 pjrt_client.cc:579] device count\n")
  summary = routes.summary()
if summary:
  print(summary, file=sys.stderr)
