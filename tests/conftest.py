import sys
from pathlib import Path

import torch

# GPU tests reuse the dist tests' training functions.
sys.path.insert(0, str(Path(__file__).parent / "dist"))

# The pytest process computes references while spawned ranks use the cores: two intra-op threads
# spinning against them made in-process work up to 20x slower on this 2-core machine.
torch.set_num_threads(1)
