"""A NumPy-backed stand-in for CuPy, for CPU tests of the GPU code paths.

``tests/test_gpu_cpu.py`` puts this folder first on a daemon's PYTHONPATH,
so ``--device cuda:0:SIZE`` builds a ``CudaArena`` whose memory is host
memory: the daemon's device branches (pool keys, devsum verification, wire
fp16 widening through ``xp``) run without a GPU.  Two fake devices exist.

The arena's memory (``empty``, ``zeros``, ...) is plain NumPy, because the
daemon hands it to UCX, which must see host memory here.  What a *client*
makes with ``asarray`` is a fake device array (``ndarray``): not
a NumPy array, carrying ``__cuda_array_interface__``, so the client takes
its device path (``rpcbuf.control.client.arrays``) and whatever refuses device
memory for real (``store_batch``, ``store_tensors``) refuses it here too,
and ``numpy.asarray`` of one raises ``TypeError``, as CuPy's does.
The fake has no ``RawKernel``, ``UnownedMemory`` or ``MemoryPointer``:
code that needs them runs only on a GPU (tests/test_gpu.py).
"""

from typing import Any

import numpy as _np
from numpy import *  # noqa: F403  (empty, copyto, uint8, float16, float32, ...)

from . import cuda


class ndarray:  # CuPy's name
    """A fake device array over a NumPy array (``_host``)."""

    def __init__(self, host: Any) -> None:
        self._host = _np.asarray(host)
        self.device = cuda.Device(0)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.ctypes.data, False), "version": 3, "strides": None}

    dtype = property(lambda self: self._host.dtype)
    shape = property(lambda self: self._host.shape)
    nbytes = property(lambda self: self._host.nbytes)
    flags = property(lambda self: self._host.flags)

    def __array__(self, *args: Any, **kw: Any) -> Any:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def reshape(self, *shape: Any) -> "ndarray":
        return ndarray(self._host.reshape(*shape))

    def view(self, dtype: Any) -> "ndarray":
        return ndarray(self._host.view(dtype))

    def get(self) -> Any:
        return self._host.copy()


def asarray(a: Any, dtype: Any = None) -> ndarray:
    return ndarray(_np.array(a._host if isinstance(a, ndarray) else a, dtype=dtype))


def ascontiguousarray(a: Any) -> ndarray:
    return ndarray(_np.ascontiguousarray(a._host if isinstance(a, ndarray) else a))


def asnumpy(a: Any) -> Any:
    return a.get() if isinstance(a, ndarray) else _np.asarray(a)
