"""`UserError`: the base of the exceptions llmrl raises for its user's mistakes; and where the user's own
code failed (`UserCodeFailure`, `code_location`); `ServerUnavailableError`: a server the run needs
stopped answering.

The CLI prints such an error's message and exits with status 2 (1 for a `UserCodeError`: the run
started, and the user's code failed in it; 75 for a `ServerUnavailableError`: the same command may
succeed later); any other exception is a bug and keeps its traceback. A `UserError` is a
`ValueError`, so callers of the Python API may catch either.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import CodeType
from typing import Any


class UserError(ValueError):
    """What the user gave llmrl is wrong (a config field, a plug-in name, a model spec, a data file); the
    message says what."""


class ModelSpecError(UserError):
    """A model spec names nothing llmrl can load, or a model llmrl cannot train and serve alike."""


class UserCodeError(UserError):
    """The user's code (reward functions, an agent's `reward` or `observe`, an agent program) failed in
    too many of a run's rollouts to go on training; the message names the most frequent failure."""


class ServerUnavailableError(RuntimeError):
    """A server the run needs (its inference server, a teacher, an agent's environment server) stopped
    answering: nothing it produced since is kept, and rerunning the same command once it answers
    resumes (the CLI exits with 75). The message is one line."""


class EnvironmentUnavailableError(ServerUnavailableError):
    """An agent's environment server (``agent_type: openenv``) did not answer (a refused or lost
    connection, no answer in time, a 5xx): the message names the agent, the server and since when."""


class UserCodeFailure(Exception):
    """One call of the user's code failed, or returned something that cannot be used; the message starts
    with where (`code_location`), so that the rollout's `failure_reason` points at the line to fix."""

    def __init__(self, where: str | None, detail: str):
        super().__init__(f"{where}: {detail}" if where else detail)
        self.where = where
        self.detail = detail

    @classmethod
    def returned(cls, where: str | None, value: Any, expected: str) -> UserCodeFailure:
        """The failure of code that returned `value` where `expected` was needed (`value` cut short: the
        message is logged and stored with the rollout)."""
        text = repr(value)
        shown = text if len(text) <= 80 else f"{text[:77]}..."
        return cls(where, f"returned {shown}; expected {expected}")


# Frames in these folders are never the user's: llmrl itself, the standard library, installed packages.
_LIBRARY_FOLDERS = tuple(
    {
        os.path.join(os.path.realpath(folder), "")
        for folder in (
            str(Path(__file__).parent),
            *(sysconfig.get_paths().get(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        )
        if folder
    }
)


def code_location(error: BaseException | None, code: Callable[..., Any] | None = None) -> str | None:
    """Where the user's code failed, as ``my_rewards.py:12 in accuracy``.

    The deepest frame of `error`'s traceback that is the user's (not llmrl's, the standard library's
    or an installed package's), naming the outermost such frame too when it is another function
    (``in parse (called by accuracy)``); without one, where `code` is defined; None when neither is
    known. Paths under the working directory are shown relative to it.
    """
    frames: list[tuple[CodeType, int]] = []
    traceback = error.__traceback__ if error is not None else None
    while traceback is not None:
        frames.append((traceback.tb_frame.f_code, traceback.tb_lineno))
        traceback = traceback.tb_next
    own = [(body, line) for body, line in frames if _is_users(body.co_filename)]
    if own:
        (entry, _), (deepest, line) = own[0], own[-1]
        where = f"{shown_path(deepest.co_filename)}:{line} in {_name(deepest)}"
        return where if _name(entry) == _name(deepest) else f"{where} (called by {_name(entry)})"
    body = _code_of(code) if code is not None else None
    if body is None:
        return None
    return f"{shown_path(body.co_filename)}:{body.co_firstlineno} in {_name(body)}"


def _name(body: CodeType) -> str:
    """The function's qualified name, without the ``<locals>`` of functions defined in functions; a
    comprehension is named as the function it is written in (Python 3.11 runs it as a function)."""
    name = body.co_qualname.replace(".<locals>.", ".")
    for comprehension in (".<listcomp>", ".<genexpr>", ".<dictcomp>", ".<setcomp>"):
        name = name.removesuffix(comprehension)
    return name


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: no file to point at
        return False
    return not os.path.realpath(filename).startswith(_LIBRARY_FOLDERS)


def _code_of(code: Callable[..., Any]) -> CodeType | None:
    function = inspect.unwrap(code)
    function = getattr(function, "func", function)  # functools.partial
    body = getattr(function, "__code__", None)
    if body is None:  # an object with a __call__ method
        body = getattr(type(function).__call__, "__code__", None)
    return body if isinstance(body, CodeType) else None


def shown_path(filename: str) -> str:
    """`filename` relative to the working directory when it lies under it, else absolute."""
    path = os.path.abspath(filename)
    relative = os.path.relpath(path)
    return path if relative.startswith(os.pardir) else relative
