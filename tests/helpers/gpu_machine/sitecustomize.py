"""This interpreter, as on a GPU machine with PyPI's CUDA build of torch and no CUDA toolkit.

Put this folder on ``PYTHONPATH`` and every Python process started there imports it first:
torch reports a CUDA build (``torch.version.cuda``, NCCL) and, unless ``EMULATE_GPUS=0``, one
H100-like device (``is_available``, ``device_count``, its capability, bf16), while no CUDA
toolkit is found (``torch.utils.cpp_extension.CUDA_HOME`` is None, as without nvcc, even where
this machine has one). Nothing runs on a GPU: it is for code that only asks (an install's build
scripts, the start-up checks). ``EMULATE_TORCH_CUDA`` sets the CUDA version (default 13.0, PyPI's
torch 2.13).
"""

import os

import torch
import torch.cuda.nccl
import torch.utils.cpp_extension

torch.version.cuda = os.environ.get("EMULATE_TORCH_CUDA", "13.0")
torch.cuda.nccl.version = lambda: (2, 29, 7)
torch.utils.cpp_extension.CUDA_HOME = None
if os.environ.get("EMULATE_GPUS", "1") != "0":
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
