"""``devsum``: one 64-bit checksum that NumPy (host) and a CUDA kernel
(device) compute identically; xxh3 is sequential and runs badly on a GPU.

For bytes ``b[0..n)``:

1. Pad ``b`` with zeros to a multiple of 8 and read ``m = ceil(n / 8)``
   little-endian uint64 words ``w[i]`` (bytes ``8i .. 8i+7`` of the data,
   not of any address: unaligned slices give the same answer).
2. ``S = sum(w[i] * (2*i + 1)) mod 2**64`` (odd weights; addition mod 2**64
   is associative, so any reduction order gives the same bits).
3. ``h = S xor (n * 0x9E3779B97F4A7C15 mod 2**64)``, then the murmur3 64-bit
   finaliser: ``h ^= h >> 33; h *= 0xFF51AFD7ED558CCD; h ^= h >> 33;
   h *= 0xC4CEB9FE1A85EC53; h ^= h >> 33`` (all mod 2**64).

It detects transfer and memory corruption; it is not adversarial-resistant
(neither is xxh3).

``memory_kind`` is the one test of where an array's memory lives, for every
layer above (the question ``devsum`` asks first).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

_CUDA_DLPACK = (2, 13)  # kDLCUDA, kDLCUDAManaged (kDLCUDAHost, 3, is host memory)


def memory_kind(obj: Any) -> str:
    """Where an array's memory lives, the one place this is asked: "host",
    "cuda", or another torch device's type ("meta", "mps", ...).  NumPy, the
    buffer protocol and unknown objects are "host"; ``__cuda_array_interface__``
    and DLPack's CUDA devices are "cuda"."""
    if isinstance(obj, np.ndarray):
        return "host"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        device = str(obj.device.type)
        return "host" if device == "cpu" else device
    if hasattr(obj, "__cuda_array_interface__"):
        return "cuda"
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return "cuda" if int(dev()[0]) in _CUDA_DLPACK else "host"
        except Exception:
            return "host"
    return "host"


M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_CHUNK = 1 << 20  # words per NumPy step (8 MiB of data, 16 MiB of temporaries)
_ODD = np.arange(_CHUNK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def finish(s: int, n: int) -> int:
    """Step 3: mix the word sum ``s`` with the length ``n``."""
    h = (s ^ (n * GOLDEN)) & M64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    h ^= h >> 33
    return h


def reference(data: bytes) -> int:
    """The definition in plain Python (slow; for tests and readers)."""
    n = len(data)
    padded = bytes(data) + b"\0" * (-n % 8)
    s = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        s = (s + w * (2 * i + 1)) & M64
    return finish(s, n)


def host_devsum(data: Any) -> int:
    b = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = int(b.nbytes)
    full = n // 8
    s = 0
    with np.errstate(over="ignore"):
        words = b[: full * 8].view("<u8")  # NumPy reads unaligned words too
        for base in range(0, full, _CHUNK):
            w = words[base : base + _CHUNK]
            k = len(w)
            # sum(w * (2*(base+j)+1)) = sum(w * odd[j]) + 2*base*sum(w)   (mod 2**64)
            part = int(np.multiply(w, _ODD[:k]).sum(dtype=np.uint64))
            part += 2 * base * int(w.sum(dtype=np.uint64))
            s = (s + part) & M64
    if n % 8:
        tail = bytes(b[full * 8 :]) + b"\0" * (8 - n % 8)
        s = (s + int.from_bytes(tail, "little") * (2 * full + 1)) & M64
    return finish(s, n)


_KERNEL_SRC = r"""
extern "C" __global__
void rpcbuf_devsum(const unsigned char* p, unsigned long long n, unsigned long long* out) {
    const unsigned long long nw = n / 8;
    const bool aligned = (((unsigned long long)p) & 7ULL) == 0;
    unsigned long long acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long gid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned long long i = gid; i < nw; i += stride) {
        unsigned long long w;
        if (aligned) {
            w = reinterpret_cast<const unsigned long long*>(p)[i];
        } else {
            w = 0;
            for (int k = 7; k >= 0; --k) w = (w << 8) | (unsigned long long)p[i * 8 + k];
        }
        acc += w * (2ULL * i + 1ULL);
    }
    if (gid == 0 && (n & 7ULL)) {  /* the tail word, zero-padded */
        unsigned long long w = 0;
        for (long long k = (long long)(n & 7ULL) - 1; k >= 0; --k)
            w = (w << 8) | (unsigned long long)p[nw * 8 + k];
        acc += w * (2ULL * nw + 1ULL);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
"""

_kernels: dict[int, Any] = {}


def device_devsum(arr: Any) -> int:
    """``devsum`` of a C-contiguous CuPy array, on its GPU (one kernel)."""
    import cupy

    if not arr.flags.c_contiguous:
        raise ValueError("devsum needs a C-contiguous array")
    n = int(arr.nbytes)
    with arr.device:
        dev = arr.device.id
        kernel = _kernels.get(dev)
        if kernel is None:
            kernel = _kernels[dev] = cupy.RawKernel(_KERNEL_SRC, "rpcbuf_devsum")
        out = cupy.zeros(1, dtype=cupy.uint64)
        if n:
            threads = 256
            blocks = max(1, min(-(-(n // 8) // threads), 4096))
            kernel((blocks,), (threads,), (arr, cupy.uint64(n), out))
        s = int(out.get()[0])  # synchronises the current stream
    return finish(s, n)


def devsum(data: Any) -> int:
    """``devsum`` of host bytes or of a CuPy array (on its GPU)."""
    if memory_kind(data) == "cuda":
        return device_devsum(data)
    return host_devsum(data)
