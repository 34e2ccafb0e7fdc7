"""The client's half of ``load_file``: tensors of a file on the node's own
disk, named with where they lie and their hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.control.wire.manifest import Packed

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class FileTensor:
    """A tensor of a model file: its manifest entry, its bytes in the file,
    its ``offset`` in the buffer, its xxh3-128 and xxh3-64, and what the file
    says it is (None: not known)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int
    offset: int
    digest: int
    checksum: int
    source_type: str | None = None
    logical_shape: tuple[int, ...] | None = None


def request(buffer_id: str, path: str, file_size: int,
            tensors: Sequence[FileTensor]) -> P.LoadFile:
    """One ``load_file`` request, sorted by buffer offset.  Raises
    BAD_REQUEST for more tensors than one request may carry."""
    if len(tensors) > P.MAX_ITEMS // 2:
        raise BadRequest(f"one load_file carries at most {P.MAX_ITEMS // 2} tensors, "
                         f"got {len(tensors)}")
    items = sorted(tensors, key=lambda t: t.offset)
    words = np.empty(2 * len(items), dtype="<u8")
    words[0::2] = [t.digest & MASK64 for t in items]
    words[1::2] = [t.digest >> 64 for t in items]
    packed = Packed.of_columns([t.name for t in items], [t.dtype for t in items],
                               [t.shape for t in items],
                               [t.source_type for t in items],
                               [t.logical_shape for t in items])
    return P.LoadFile(
        buffer_id=buffer_id, path=path, file_size=file_size,
        file_offsets=P.pack_u64([t.file_offset for t in items]),
        offsets=P.pack_u64([t.offset for t in items]),
        sizes=P.pack_u64([t.nbytes for t in items]),
        hashes=P.U64Array(words.tobytes()),
        checksums=P.pack_u64([t.checksum for t in items]), **packed.fields())
