"""The trusted test harness of the code environment: the program `sandbox.run` starts for a reward.

It runs inside the sandbox as two processes, so that the model's code never shares an interpreter
with the tests or with the channel that reports their outcome:

- the **checker** (the sandbox's main process) reads the job (setup, solution, tests) from its
  stdin, runs the setup and the tests itself, and writes one JSON line per test to a private copy
  of its stdout: ``{"test": 3, "passed": true, "error": null}``. Nothing else writes there.
- the **solver** is forked before the job is read, so it never holds the tests. It points its
  stdout at stderr, closes every other descriptor but two pipes, then runs the setup and the
  solution. After that it only answers the checker's requests over the pipes: call this object
  with these arguments, read this attribute.

The names the solution defines appear in the tests' namespace as proxies: calling one sends the
call to the solver and returns its result. Results cross the pipe as serialised plain values
(None, bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset; exact types, so
no subclass with its own ``__eq__``) and are compared by the checker; any other object stays in
the solver and comes back as an opaque handle that can be called, passed back or asked for an
attribute, but has no truth value and is equal only to itself. Exceptions come back by type name
(builtin types are raised as themselves, any other as `SolutionError`). Modules come back by name
and are imported by the checker from the standard library.

So whatever the solution does to its own interpreter (exit, patch the runner, walk ``gc`` or the
stack, print fake results, return an object equal to everything), the most it can do is answer a
call with a wrong plain value. There is no secret to steal: the outcome is decided by the checker.
Limits: tests see the solution's return values, not changes it makes to their arguments in place,
and cannot pass functions to it. This file runs with the standard library only (``python -I -S``).
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
import traceback

MAX_MESSAGE_BYTES = 8 << 20
"""Largest request or answer on the pipes; a longer one ends the solver's turn as a failure."""

_REQUEST_FD, _ANSWER_FD = 3, 4  # the solver's two pipe ends, at fixed numbers


class SolutionError(Exception):
    """An exception the solution raised whose type is not a builtin one, or a broken answer."""


class SolverGone(SolutionError):
    """The solver process ended or sent something that is not an answer."""


# -- plain values on the wire ------------------------------------------------------------------

_SCALARS = (bool, int, float, str)


def encode(value, handle_of):
    """`value` as JSON-able data: plain values by content (exact types), anything else by `handle_of`."""
    kind = type(value)
    if value is None or kind in _SCALARS:
        return value
    if kind is list:
        return [encode(item, handle_of) for item in value]
    if kind is tuple:
        return {"tuple": [encode(item, handle_of) for item in value]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [encode(item, handle_of) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, handle_of), encode(v, handle_of)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind is type(sys):
        return {"module": value.__name__}
    return {"handle": handle_of(value)}


def decode(data, object_of):
    """The value `encode` made `data` from; handles are turned into objects by `object_of`."""
    if data is None or type(data) in _SCALARS:
        return data
    if type(data) is list:
        return [decode(item, object_of) for item in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    ((tag, payload),) = data.items()
    if tag == "tuple":
        return tuple(decode(item, object_of) for item in payload)
    if tag in ("set", "frozenset"):
        items = [decode(item, object_of) for item in payload]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "dict":
        return {decode(k, object_of): decode(v, object_of) for k, v in payload}
    if tag == "bytes":
        return bytes.fromhex(payload)
    if tag == "complex":
        real, imaginary = payload
        if type(real) is not float or type(imaginary) is not float:
            raise ValueError("complex parts must be floats")
        return complex(real, imaginary)
    if tag == "module":
        return _standard_module(payload)
    if tag == "handle":
        return object_of(payload)
    raise ValueError(f"unknown tag {tag!r}")


def _standard_module(name):
    """The checker's own import of a standard-library module (never one the solution wrote)."""
    if type(name) is not str or name.partition(".")[0] not in sys.stdlib_module_names:
        raise ValueError(f"module {name!r} is not in the standard library")
    return importlib.import_module(name)


def _send(stream, message):
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def _receive(stream):
    """The next message, or SolverGone when the stream ended or carried no complete JSON line."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line.endswith(b"\n"):
        raise SolverGone("the solution process ended or sent an oversized answer")
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise SolverGone("the solution process sent something that is not an answer") from None


# -- the solver (untrusted side) ---------------------------------------------------------------


def _serve(requests, answers):
    """Run the setup and solution, report their names, then answer calls until the pipe closes."""
    objects = {}

    def handle_of(value):
        objects[id(value)] = value
        return id(value)

    def object_of(handle):
        if handle not in objects:
            raise ValueError(f"unknown handle {handle!r}")
        return objects[handle]

    def outcome(compute):
        try:
            return {"value": encode(compute(), handle_of)}
        except RecursionError:
            return {"raise": ["RecursionError", "the value is nested too deeply to return"]}
        except BaseException as exc:  # noqa: BLE001 - SystemExit included: the solution's own doing
            return {"raise": [type(exc).__name__, str(exc)[:1000]]}

    source = _receive(requests)["source"]
    namespace = {"__name__": "__main__"}
    error = None
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - its names defined so far still take part
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:1000]
    names = {name: value for name, value in namespace.items() if not name.startswith("__")}
    _send(answers, {**outcome(lambda: names), "error": error})
    while True:
        request = _receive(requests)
        _send(answers, outcome(lambda request=request: _perform(request, object_of)))


def _perform(request, object_of):
    """Carry out one request of the checker in the solver: a call or an attribute read."""
    target = object_of(request["target"])
    if request["op"] == "call":
        return target(*decode(request["args"], object_of), **decode(request["kwargs"], object_of))
    return getattr(target, request["name"])


def _start_solver():
    """Fork the solver; returns the checker's (request, answer) streams."""
    request_read, request_write = os.pipe()
    answer_read, answer_write = os.pipe()
    if os.fork() == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # the job arrives on the checker's stdin after this fork
            os.dup2(2, 1)  # the report descriptor is the checker's alone
            ends = os.dup(request_read), os.dup(answer_write)  # above every number dup2 targets below
            os.dup2(ends[0], _REQUEST_FD)
            os.dup2(ends[1], _ANSWER_FD)
            os.closerange(_ANSWER_FD + 1, os.sysconf("SC_OPEN_MAX"))
            sys.stdout = sys.stderr  # line-buffered: prints reach the log before the run is killed
            _serve(os.fdopen(_REQUEST_FD, "rb"), os.fdopen(_ANSWER_FD, "wb"))
        except SolverGone:
            pass
        finally:
            os._exit(0)
    os.close(request_read)
    os.close(answer_write)
    return os.fdopen(request_write, "wb"), os.fdopen(answer_read, "rb")


# -- the checker (trusted side) ----------------------------------------------------------------


class Remote:
    """An object that lives in the solver: callable, and readable attribute by attribute."""

    __slots__ = ("_handle", "_solver")

    def __init__(self, solver, handle):
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_solver", solver)

    def __call__(self, *args, **kwargs):
        return self._solver.ask({"op": "call", "target": self._handle, "args": list(args), "kwargs": kwargs})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._solver.ask({"op": "getattr", "target": self._handle, "name": name})

    def __bool__(self):
        raise TypeError("an object of the solution has no truth value in a test; return a plain value")

    def __repr__(self):
        return f"<solution object {self._handle}>"


class Solver:
    """The checker's end of the pipes to the solver process."""

    def __init__(self, requests, answers):
        self.requests = requests
        self.answers = answers

    def handle_of(self, value):
        if type(value) is not Remote or value._solver is not self:
            raise TypeError(f"cannot pass a {type(value).__name__} to the solution: plain values only")
        return value._handle

    def object_of(self, handle):
        return Remote(self, handle)

    def load(self, source):
        """Run the solution; returns its names as values and proxies, and its error (None if it ran)."""
        _send(self.requests, {"source": source})
        answer = _receive(self.answers)
        return self._result(answer), answer.get("error")

    def ask(self, request):
        request = {
            **request,
            "args": encode(request.get("args", []), self.handle_of),
            "kwargs": encode(request.get("kwargs", {}), self.handle_of),
        }
        try:
            _send(self.requests, request)
        except OSError:
            raise SolverGone("the solution process ended") from None
        return self._result(_receive(self.answers))

    def _result(self, answer):
        if type(answer) is not dict:
            raise SolverGone("the solution process sent something that is not an answer")
        if "raise" in answer:
            try:
                name, message = answer["raise"]
            except (ValueError, TypeError):
                raise SolverGone("the solution process sent a broken exception") from None
            raise _exception_type(name)(str(message)[:1000])
        try:
            return decode(answer["value"], self.object_of)
        except (ValueError, KeyError, TypeError, RecursionError, ImportError) as exc:
            raise SolverGone(f"the solution process sent a broken value ({type(exc).__name__})") from None


def _exception_type(name):
    """The builtin exception named `name`; `SolutionError` for any other name."""
    found = getattr(builtins, name, None) if type(name) is str else None
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return SolutionError


def main():
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of tests and solution go to stderr; stdout carries the report only
    solver = Solver(*_start_solver())
    job = json.load(sys.stdin)
    setup, tests = job["setup"], job["tests"]
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(setup, "setup.py", "exec"), namespace)
    except BaseException:  # noqa: BLE001 - the tests then fail on what it did not define
        traceback.print_exc()
    try:
        names, error = solver.load(setup + "\n" + job["solution"])
        if type(names) is not dict:
            raise SolverGone("the solution process sent no names")
    except Exception as exc:  # noqa: BLE001 - a solver that cannot report its names has none
        names, error = {}, f"{type(exc).__name__}: {exc}"
    for name, value in names.items():  # the setup's own names are the trusted ones
        if type(name) is str and name.isidentifier():
            namespace.setdefault(name, value)
    if error is not None:
        print(f"solution: {error}", file=sys.stderr)
    for index, test in enumerate(tests):
        outcome = None
        try:
            exec(compile(test, f"test_{index}.py", "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: a test either runs through or fails
            outcome = f"{type(exc).__name__}: {exc}"[:500]
        report.write(json.dumps({"test": index, "passed": outcome is None, "error": outcome}) + "\n")


if __name__ == "__main__":
    main()
