"""mismatch-probe: train-inference mismatch profiler for LLM reinforcement learning.

The core package never imports an engine (torch, vLLM, transformers) at import time, so
``report`` and ``gate`` work on a laptop without them.
"""

__version__ = "0.1.0"
