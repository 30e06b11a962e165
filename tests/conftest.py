import os
import sys

import torch

# Tests build small models; one thread keeps runs repeatable and leaves a core for the rest.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))
