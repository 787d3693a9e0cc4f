import sys
from pathlib import Path

# GPU tests reuse the dist tests' training functions.
sys.path.insert(0, str(Path(__file__).parent / "dist"))
