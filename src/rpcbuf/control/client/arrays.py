"""The client's view of user arrays: a flat ``uint8`` array over the same
memory, host (NumPy) or device (CuPy), without copying.

- Accepted: NumPy, the buffer protocol, torch (CPU or CUDA), CuPy, the CUDA
  array interface, DLPack.  Device memory goes to UCX as a CuPy array.
- Torch dtypes NumPy lacks (bfloat16, float8s) are seen as their bits
  beside their safetensors name (``BF16`` ...): ``host_array`` is the one
  place a tensor becomes a NumPy array, ``torch_view`` the way back.
- Verbs that take host arrays only refuse GPU memory in one place,
  ``refuse_device``, before converting anything.
- Streams: ``cupy.from_dlpack``/``asarray`` make CuPy's stream wait for the
  producer's; ``prepare`` then synchronises it, so a transfer starts only
  after every kernel that wrote the tensor finished.
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
    return str(getattr(obj, "dtype", "uint8")).removeprefix("torch.")


# torch dtype -> the safetensors name of it, for the dtypes NumPy has none for.
TORCH_BITS = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
              "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
              "float8_e8m0fnu": "F8_E8M0"}
_TORCH_OF = {v: k for k, v in TORCH_BITS.items()}
FRAMEWORKS = ("numpy", "torch")


def host_array(obj: Any) -> tuple[np.ndarray, str | None]:
    """A NumPy array over ``obj``'s host memory (no copy) and, for a torch
    dtype NumPy lacks, its safetensors name (the array is then its bits).
    BAD_REQUEST for a tensor off the host, a sparse one, or a dtype no model
    file holds."""
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
    """A torch tensor over ``array``'s memory (no copy), of the dtype
    ``source_type`` names, shaped as ``logical_shape`` when the same elements."""
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
    """A flat uint8 view of a host array.  BAD_REQUEST as ``as_bytes``."""
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
    """BAD_REQUEST for a value in GPU memory (``refusal`` says why,
    ``names`` name it), before any value is converted."""
    on_gpu = next((i for i, v in enumerate(values) if memory_kind(v) == "cuda"), None)
    if on_gpu is not None:
        what = f"tensor {names[on_gpu]!r}" if names is not None else "an array"
        raise BadRequest(f"{what} is in GPU memory: {refusal}")


def host_data(values: list[Any], refusal: str, writable: bool = False) -> list[np.ndarray]:
    """The bytes of ``values`` for a verb that takes host arrays only:
    ``values`` itself when all are contiguous NumPy arrays (the common case),
    else flat uint8 views.  BAD_REQUEST for GPU memory."""
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
    """A flat uint8 view of ``array``: NumPy or CuPy.  A non-contiguous source
    is copied once; a read target must be contiguous and writable
    (BAD_REQUEST)."""
    if type(array) is np.ndarray and array.dtype is _U8 and array.ndim == 1 \
            and array.flags.c_contiguous and (not writable or array.flags.writeable):
        return array  # already what it would become (the common case: no new views)
    if memory_kind(array) == "cuda":
        return device_bytes(array, writable)
    return host_bytes(array, writable)


def prepare(data: Any) -> None:
    """Before a transfer: wait for the GPU work on ``data``'s memory."""
    if memory_kind(data) != "cuda":
        return
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(data, cp.ndarray):
        with data.device:
            cp.cuda.get_current_stream().synchronize()


def to_wire_f16(array: Any) -> tuple[Any, Any]:
    """(float16 wire bytes, the float32 values the daemon will hold)."""
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


