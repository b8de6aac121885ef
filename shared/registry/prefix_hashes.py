"""Chained page hashes of a token sequence: hash i covers tokens of pages 0..i.

The gateway sends them to the router (never the token ids); prefill workers publish
the hashes of the pages their prefix cache holds (kv_events). Both sides must hash
the same way, so this is the one definition. Only full pages are hashed. Serving always
seeds the chain with the request's cache namespace (shared/engine/cache_scope.py), a keyed
hash only the gateway can make: the registry holds salted hashes, which nobody can
recompute from a guessed prompt, and one tenant's pages never match another's.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_U64 = struct.Struct("<Q")


def chained_page_hashes(token_ids: Sequence[int], page_size: int, *, seed: int = 0) -> list[int]:
    """uint64 hash per full page; page i's hash mixes page i-1's hash, so equal hash
    at position i means equal tokens over pages 0..i (up to 64-bit collisions)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes: list[int] = []
    prev = seed
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start:start + page_size]
        digest = hashlib.blake2b(_U64.pack(prev), digest_size=8)
        digest.update(struct.pack(f"<{page_size}i", *page))
        prev = _U64.unpack(digest.digest())[0]
        hashes.append(prev)
    return hashes
