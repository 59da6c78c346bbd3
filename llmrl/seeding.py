"""Seeds derived from the run seed, so every random choice of a run follows from its config."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed for the stream named by `keys` (e.g. ``"step", 3``), independent of other names.

    Hash-derived rather than ``seed + k``, so nearby run seeds never share streams.
    """
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
