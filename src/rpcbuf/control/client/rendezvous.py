"""Rendezvous (highest random weight) hashing: node ``n``'s weight for
``key`` is the xxh3-64 of the key seeded with ``node_seed(n)``, the xxh3-64
of its address; a key's nodes are ordered by weight, highest first.  No
table and no state: the same membership gives every client the same order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import xxhash


def node_seed(node: str) -> int:
    return xxhash.xxh3_64_intdigest(node.encode())


def rank(key: str, seeds: Mapping[str, int], n: int | None = None) -> list[str]:
    """The nodes of ``seeds`` (node -> ``node_seed``) for ``key``, highest
    weight first (ties by name); the first ``n`` only when given."""
    data = key.encode()
    weighed = ((xxhash.xxh3_64_intdigest(data, seed=s), node) for node, s in seeds.items())
    top = heapq.nlargest(n, weighed) if n is not None else sorted(weighed, reverse=True)
    return [node for _, node in top]


def ranks(keys: Sequence[str], seeds: Mapping[str, int], n: int | None = None
          ) -> list[list[str]]:
    """``rank`` of every key (read-only lists, shared); one node: no hashing."""
    items = list(seeds.items())
    if len(items) <= 1:
        only = [node for node, _ in items]
        return [only] * len(keys)
    h = xxhash.xxh3_64_intdigest
    out: list[list[str]] = []
    add = out.append
    for k in keys:
        data = k.encode()
        weighed = sorted([(h(data, s), node) for node, s in items], reverse=True)
        add([node for _, node in weighed[:n]])
    return out
