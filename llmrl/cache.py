"""Where llmrl keeps what it builds once and reuses (the tiny model)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LLMRL_CACHE_DIR`` when set, else ``~/.cache/llmrl``."""
    return Path(os.environ.get("LLMRL_CACHE_DIR") or Path.home() / ".cache" / "llmrl").expanduser()
