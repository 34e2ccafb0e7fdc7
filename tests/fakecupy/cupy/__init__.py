"""A NumPy-backed stand-in for CuPy, for CPU tests of the GPU code paths.

``tests/test_gpu_cpu.py`` puts this folder first on a daemon's PYTHONPATH,
so ``--device cuda:0:SIZE`` builds a ``CudaArena`` whose memory is host
memory: the daemon's device branches (pool keys, devsum verification, wire
fp16 widening through ``xp``) run without a GPU.  Two fake devices exist.
"""

from numpy import *  # noqa: F403  (empty, copyto, uint8, float16, float32, ...)
from numpy import asarray as asnumpy  # noqa: F401

from . import cuda  # noqa: F401
