"""``rpcbuf.dataplane.checksum.digests``: both hashes in one pass, equal to the two
hashes computed apart, for every length around XXH3's input-size paths."""

from __future__ import annotations

import numpy as np
import pytest

from rpcbuf.dataplane import checksum as C


@pytest.mark.parametrize("n", [*range(0, 300), 1023, 1024, 1025, 4096, 65_537, (1 << 20) + 3])
def test_digests_are_the_two_hashes(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert C.digests(data) == (C.digest128(data), C.checksum(data))


def test_one_pass_holds_on_this_build_and_its_fallback_is_still_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert C.ONE_PASS  # the XXH3 specification's long-input path
    monkeypatch.setattr(C, "ONE_PASS", False)
    data = np.arange(5000, dtype=np.uint16)
    assert C.digests(data) == (C.digest128(data), C.checksum(data))


def test_digests_take_any_contiguous_buffer() -> None:
    raw = bytes(range(256)) * 3
    assert C.digests(raw) == C.digests(memoryview(raw)) == C.digests(np.frombuffer(raw, np.uint8))
