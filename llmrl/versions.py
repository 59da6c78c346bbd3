"""Weight versions of sampled tokens: the largest version, and the ``version_changes`` form that
`llmrl.types.InferenceResponse` and `llmrl.types.TokenRollout` carry (pairs [token index, version],
each where newer weights took over)."""

MAX_POLICY_VERSION = 2**63 - 1
"""Largest weight version (a signed 64-bit integer, as every client and store can hold it)."""


def check_version_changes(changes: list[tuple[int, int]], first: int, length: int) -> None:
    """`changes` (pairs [token index, version]) must start after the first of `length` tokens, at rising
    indices, each to a newer version than the one before (`first` at the start)."""
    index, version = 0, first
    for at, new in changes:
        if not index < at < length:
            raise ValueError(
                f"version_changes: token index {at} must be above {index} and below the {length} tokens"
            )
        if not version < new <= MAX_POLICY_VERSION:
            raise ValueError(f"version_changes: version {new} at token {at} must be newer than {version}")
        index, version = at, new


def expand_versions(changes: list[tuple[int, int]], first: int, length: int) -> list[int]:
    """One version per token: `first` until the first change, then each change's version from its index."""
    versions, version, start = [], first, 0
    for at, new in changes:
        versions += [version] * (at - start)
        version, start = new, at
    return versions + [version] * (length - start)
