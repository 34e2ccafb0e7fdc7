"""How an upload cuts a slot's tensors into batches (``reading.batches``).

Every tensor lands in exactly one batch, in order; no batch passes its cap
unless it is one tensor bigger than the cap; with ``first`` the caps ramp
up from it, doubling, to the bound (the first bytes go out after little
hashing, the rest in few batches).
"""

from __future__ import annotations

from rpcbuf.models.modelfile import TensorSpec
from rpcbuf.models.reading import DEFAULT_BATCH, FIRST_BATCH, batches

MiB = 1 << 20


def specs(*sizes: int) -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", "uint8", (n,), n, "U8") for i, n in enumerate(sizes)]


def cut(sizes: list[int], limit: int, first: int | None = None) -> list[list[int]]:
    got = [[s.nbytes for s in b] for b in batches(specs(*sizes), limit, first)]
    assert [n for b in got for n in b] == sizes  # each once, in order
    return got


def test_batches_without_a_ramp_fill_to_the_bound() -> None:
    assert cut([4, 4, 4, 4, 4], 8) == [[4, 4], [4, 4], [4]]
    assert cut([3, 10, 3], 8) == [[3], [10], [3]]  # a tensor past the bound goes alone
    assert cut([], 8) == []


def test_batches_ramp_up_from_first_to_the_bound() -> None:
    got = cut([MiB] * 40, 16 * MiB, 2 * MiB)
    assert [sum(b) // MiB for b in got] == [2, 4, 8, 16, 10]
    # a tensor bigger than the current cap still goes, alone, and the cap grows on
    assert cut([3 * MiB, MiB, MiB, MiB], 8 * MiB, MiB) == [[3 * MiB], [MiB, MiB], [MiB]]
    # first past the bound: the bound
    assert cut([MiB] * 4, 2 * MiB, 64 * MiB) == [[MiB, MiB], [MiB, MiB]]


def test_the_default_ramp() -> None:
    """The loader's batches: a small first one, the rest up to the bound."""
    assert FIRST_BATCH < DEFAULT_BATCH
    got = cut([4 * MiB] * 128, DEFAULT_BATCH, FIRST_BATCH)  # 512 MiB
    assert sum(got[0]) <= FIRST_BATCH
    assert all(sum(b) <= DEFAULT_BATCH for b in got)
    assert max(sum(b) for b in got) == DEFAULT_BATCH
