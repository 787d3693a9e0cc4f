"""Launcher test helper: one line on stdout and one on stderr."""

import os
import sys

print(f"stdout of rank {os.environ['RANK']}")
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
