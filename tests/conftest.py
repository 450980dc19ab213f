"""The whole suite's environment, inherited by every process a test starts.

The fused output stage's logit passes run eager here (``MEGATRON_TEMPNET_COMPILE=0``):
compiling them costs each fresh process seconds, and the suite starts hundreds.
tests/unit/test_logit_passes.py checks the compiled passes against the eager ones; the GPU
acceptance run compiles them (tests/gpu/conftest.py).
"""

import os

os.environ.setdefault("MEGATRON_TEMPNET_COMPILE", "0")
