"""The client's view of user arrays: a flat ``uint8`` array over the same
memory, host (NumPy) or device (CuPy), without copying.

Accepted: NumPy arrays and anything with the buffer protocol; PyTorch
tensors (CPU or CUDA, any dtype including bfloat16); CuPy arrays; anything
exposing ``__cuda_array_interface__`` (Numba, JAX on GPU, ...) or DLPack
(``__dlpack__``/``__dlpack_device__``).  Device memory is handed to UCX as a
CuPy array (ucxx takes ``__cuda_array_interface__`` buffers).

PyTorch's dtypes that NumPy lacks (bfloat16, the float8s) are seen as their
bits, an unsigned integer of the same width, beside the safetensors name of
their dtype (``BF16``, ``F8_E4M3``, ...): ``host_array`` is the one place a
torch tensor becomes a NumPy array, for every verb, and a manifest records
that name as the tensor's source type, as the model loader does for a BF16
file tensor.  ``torch_view`` is the way back: a tensor over the same memory
(DLPack, which carries a read-only array without torch's "not writable"
warning), of the dtype the source type names.

The verbs that take host arrays only (the batch and block verbs,
``store_tensors``) refuse GPU memory in one place, ``refuse_device``, before
converting anything; ``host_data`` is their bytes.

Streams: the producer's pending work must be finished before UCX touches the
memory.  ``cupy.from_dlpack``/``cupy.asarray`` make CuPy's current stream wait
for the producer's stream (the DLPack / CUDA array interface stream
handshake); ``prepare`` then synchronises that stream, so a transfer starts
only after every kernel that wrote the tensor has finished.
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.dataplane.devsum import memory_kind


def _torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def dtype_name(obj: Any) -> str:
    """'float32', 'bfloat16', ... of an array-like (for wire-dtype checks)."""
    return str(getattr(obj, "dtype", "uint8")).removeprefix("torch.")


# torch dtype -> the safetensors name of it, for the dtypes NumPy has none for.
TORCH_BITS = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
              "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
              "float8_e8m0fnu": "F8_E8M0"}
_TORCH_OF = {v: k for k, v in TORCH_BITS.items()}
FRAMEWORKS = ("numpy", "torch")


def host_array(obj: Any) -> tuple[np.ndarray, str | None]:
    """A NumPy array over ``obj``'s host memory (no copy for a NumPy array or
    a CPU torch tensor) and, for a torch dtype NumPy lacks, the safetensors
    name of it (the array is then its bits: ``uint16`` for bfloat16, ``uint8``
    for a float8).  BAD_REQUEST for a tensor off the host (GPU, meta), a
    sparse one, or a torch dtype no model file holds (complex32, the packed
    float4s)."""
    if isinstance(obj, np.ndarray):
        return obj, None
    if not _torch_tensor(obj):
        return np.asarray(obj), None
    import torch

    t = obj.detach()
    if memory_kind(t) != "host":
        raise BadRequest(f"this tensor is on {t.device}, not in host memory")
    if t.layout != torch.strided:
        raise BadRequest(f"this tensor is {t.layout} (convert it first: .to_dense())")
    t = t.resolve_conj().resolve_neg()
    name = str(t.dtype).removeprefix("torch.")
    source = TORCH_BITS.get(name)
    if source is not None:
        bits = {1: torch.uint8, 2: torch.uint16}[t.element_size()]
        return t.view(bits).numpy(), source
    try:
        return t.numpy(), None
    except TypeError:  # torch's own "Got unsupported ScalarType ..."
        raise BadRequest(f"torch.{name} tensors are not supported: no model file holds "
                         "them (convert first, e.g. .to(torch.float32))") from None


def check_framework(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise BadRequest(f"framework must be one of {list(FRAMEWORKS)}, got {framework!r}")
    if framework == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise BadRequest("framework='torch' needs PyTorch (pip install torch)") from None


def torch_view(array: Any, source_type: str | None = None,
               logical_shape: Any = None) -> Any:
    """A torch tensor over ``array``'s memory (NumPy or CuPy; no copy, and
    no warning for a read-only one), of the dtype ``source_type`` names
    where NumPy had none (``BF16`` bits become bfloat16), shaped as
    ``logical_shape`` when that is the same elements."""
    import torch

    t = torch.from_dlpack(array)
    target = _TORCH_OF.get(source_type or "")
    dt = getattr(torch, target, None) if target else None
    if dt is not None and t.dtype != dt and not t.dtype.is_floating_point:
        t = t.view(dt)
    if logical_shape is not None and tuple(t.shape) != tuple(logical_shape) \
            and t.numel() == math.prod(logical_shape):
        t = t.reshape(tuple(logical_shape))
    return t


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise BadRequest("this array is in GPU memory, which needs CuPy on the client "
                         "(pip install 'rpcbuf[gpu]')") from None
    return cupy


def _torch_u8(t: Any, writable: bool) -> Any:
    """A contiguous flat uint8 torch view of ``t`` (a copy only for a
    non-contiguous store source)."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        if writable:
            raise BadRequest("out must be a C-contiguous array")
        t = t.contiguous()
    if t.dtype == torch.uint8:
        return t.reshape(-1)
    return t.reshape(-1).view(torch.uint8)


def host_bytes(array: Any, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of ``array``'s host memory (``as_bytes`` for an
    array known to be on the host): NumPy, a CPU torch tensor (``host_array``),
    DLPack, or the buffer protocol.  BAD_REQUEST as ``as_bytes`` says, and for
    anything else."""
    if isinstance(array, np.ndarray):
        arr = array
    elif _torch_tensor(array):
        arr = host_array(array)[0]
    elif hasattr(array, "__dlpack__") and not _has_buffer(array):
        try:
            arr = np.from_dlpack(array)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            raise BadRequest(f"cannot view {type(array).__name__} through DLPack: {exc}") from None
    else:
        try:
            arr = np.frombuffer(array, dtype=np.uint8) if not writable else np.asarray(
                memoryview(array))
        except TypeError:
            raise BadRequest(
                f"expected a NumPy array, a tensor or a buffer, got {type(array).__name__}"
            ) from None
    if not arr.flags.c_contiguous:
        if writable:
            raise BadRequest("out must be a C-contiguous array")
        arr = np.ascontiguousarray(arr)
    if writable and not arr.flags.writeable:
        raise BadRequest("out must be writable")
    return arr.reshape(-1).view(np.uint8)


_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
_U8 = np.dtype(np.uint8)
_WRITEABLE = operator.attrgetter("flags.writeable")


def refuse_device(values: Sequence[Any], refusal: str,
                  names: Sequence[str] | None = None) -> None:
    """The check of every verb that takes host arrays only (``store_tensors``,
    ``store_batch``, the block verbs), before any value is converted:
    BAD_REQUEST for one in GPU memory (``refusal`` says why; ``names``, when
    given, name it), which ``np.asarray`` would refuse (CuPy, torch) or copy."""
    on_gpu = next((i for i, v in enumerate(values) if memory_kind(v) == "cuda"), None)
    if on_gpu is not None:
        what = f"tensor {names[on_gpu]!r}" if names is not None else "an array"
        raise BadRequest(f"{what} is in GPU memory: {refusal}")


def host_data(values: list[Any], refusal: str, writable: bool = False) -> list[np.ndarray]:
    """The bytes of ``values`` in host memory, for a verb that takes host
    arrays only: ``values`` itself when all are C-contiguous NumPy arrays (and
    writable, for ``writable``: the common case, no per-array work), else
    each as a flat uint8 view (``host_bytes``).  BAD_REQUEST for an array in
    GPU memory (``refuse_device``) or one ``host_bytes`` refuses."""
    if all(map(isinstance, values, itertools.repeat(np.ndarray))) \
            and all(map(_C_CONTIGUOUS, values)) \
            and (not writable or all(map(_WRITEABLE, values))):
        return values
    refuse_device(values, refusal)
    return [host_bytes(v, writable) for v in values]


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def device_bytes(array: Any, writable: bool = False) -> Any:
    """A flat CuPy uint8 array over ``array``'s device memory."""
    cp = _cupy()
    if _torch_tensor(array):
        arr = cp.from_dlpack(_torch_u8(array, writable))
    elif isinstance(array, cp.ndarray):
        arr = array
    elif hasattr(array, "__cuda_array_interface__"):
        arr = cp.asarray(array)
    else:
        arr = cp.from_dlpack(array)
    if not arr.flags.c_contiguous:
        if writable:
            raise BadRequest("out must be a C-contiguous array")
        with arr.device:
            arr = cp.ascontiguousarray(arr)
    return arr.reshape(-1).view(cp.uint8)


def as_bytes(array: Any, *, writable: bool = False) -> Any:
    """A flat uint8 view of ``array``: NumPy for host memory, CuPy for device
    memory.  A non-contiguous source is copied once for a store; a read
    target must be contiguous and writable (``BAD_REQUEST`` otherwise)."""
    if type(array) is np.ndarray and array.dtype is _U8 and array.ndim == 1 \
            and array.flags.c_contiguous and (not writable or array.flags.writeable):
        return array  # already what it would become (the common case: no new views)
    if memory_kind(array) == "cuda":
        return device_bytes(array, writable)
    return host_bytes(array, writable)


def prepare(data: Any) -> None:
    """Before a transfer: wait for the GPU work that produces (or last used)
    ``data``'s memory.  A no-op for host arrays."""
    if memory_kind(data) != "cuda":
        return
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(data, cp.ndarray):
        with data.device:
            cp.cuda.get_current_stream().synchronize()


def to_wire_f16(array: Any) -> tuple[Any, Any]:
    """(float16 wire bytes, the float32 values the daemon will hold) of a
    float32 tensor, on the tensor's own device."""
    if _torch_tensor(array):
        import torch

        t = array.detach()
        half = t.to(torch.float16).contiguous()
        return as_bytes(half), as_bytes(half.to(torch.float32))
    if memory_kind(array) == "cuda":
        cp = _cupy()
        values = device_bytes(array).view(cp.float32)
        with values.device:
            half = values.astype(cp.float16)
            return half.view(cp.uint8), half.astype(cp.float32).view(cp.uint8)
    values = host_bytes(array).view(np.float32)
    half = values.astype(np.float16)
    return half.view(np.uint8), half.astype(np.float32).view(np.uint8)


