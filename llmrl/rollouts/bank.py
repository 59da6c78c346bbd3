"""The rollout bank: every generated batch, on disk, until the step that trains on it is checkpointed.

``RUN_DIR/rollout_bank.jsonl`` holds one line per generated batch::

    {"crc32": 1234567890, "record": {"step": 12, "groups": [...], "agents": {...}}}

`step` is the training step the batch is for, `groups` its rollout groups, `agents` the agents'
state right after drawing it (their problem cursors). The checksum covers the record's canonical
JSON, so a line torn by a crash, or damaged later, is detected; it is skipped with a warning and
never loaded. Lines are appended and flushed one at a time, as batches complete.

On resume from a checkpoint at step k, the batches banked for steps k+1, k+2, ... (generated
before the crash, possibly on older weights when generation runs ahead) are trained on before new
ones are generated, each exactly once. A checkpoint compacts the bank to the batches it has not
trained on yet.

With partial rollouts (`llmrl.rollouts.partial`) groups are generated one at a time and batches are
made of whichever complete first, so the bank records groups, not batches:

    {"launch": [40, 41], "pending": [40, 41],          groups 40 and 41 started together, from the
     "before": {...}, "agents": {...}}                 agents' state before, leaving them in `agents`
    {"group": 40, "rollouts": {...}}                   group 40 complete
    {"batch": 6, "indices": [33, 35, 40, ...]}         the groups step 6 trains on
    {"redo": [33, 35]}                                 generate these again (too stale, or refused)

A resumed run trains the recorded batches of later steps again as they were, puts the complete groups
no batch took back in the pool, and generates the groups that were still running (or are to be redone)
again: it replays their launch's draws from the agents' state before it, so each gets the problem
it had, and keeps only those. A checkpoint drops the lines of the groups it trained (a launch's
`pending` keeps the groups of it not yet trained).
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmrl.files import atomic_write
from llmrl.telemetry import ends_with_newline, read_jsonl
from llmrl.types import RolloutGroup

BANK_FILE = "rollout_bank.jsonl"

_ACCESS = threading.RLock()
"""Held while any bank of this process reads, appends or rewrites: generation appends from its own
thread while a checkpoint compacts (which reads, within), and a line being appended is not torn."""


@dataclass
class BankedBatch:
    """One generated batch: the step it is for, its groups, and the agents' state after drawing it."""

    step: int
    groups: list[RolloutGroup]
    agent_state: dict[str, Any]

    def to_line(self) -> str:
        record = {
            "step": self.step,
            "groups": [g.model_dump(mode="json") for g in self.groups],
            "agents": self.agent_state,
        }
        return _line(record)


@dataclass
class Launch:
    """Groups started together: their indices in launch order, and the agents' state before."""

    indices: list[int]
    before: dict[str, Any]


@dataclass
class PartialRecords:
    """What the bank holds of a run with partial rollouts (see the module docstring)."""

    launches: list[Launch] = field(default_factory=list)
    """The launches with groups not yet done, in launch order."""
    pending: list[int] = field(default_factory=list)
    """Their groups not yet trained when the bank was last compacted."""
    agent_state: dict[str, Any] | None = None
    """The agents' state after the newest launch."""
    next_index: int | None = None
    """The index after the newest launch's."""
    groups: dict[int, RolloutGroup] = field(default_factory=dict)
    """Complete groups by index (none that is to be redone), in completion order."""
    batches: dict[int, list[int]] = field(default_factory=dict)
    """Training step -> the indices of the groups its batch took."""


Entry = BankedBatch | dict[str, Any]
_PARTIAL_KINDS = frozenset({"launch", "group", "batch", "redo"})


class RolloutBank:
    """Append-only store of generated batches in a run folder (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / BANK_FILE

    def append(self, batch: BankedBatch) -> None:
        """Write one batch as one flushed line (a torn line from an earlier crash is cut off first)."""
        self._append(batch.to_line())

    def append_record(self, record: dict[str, Any]) -> None:
        """Write one partial-rollouts record (a launch, a group or a batch) as one flushed line."""
        self._append(_line(record))

    def read(self) -> list[BankedBatch]:
        """Every intact batch, in file order; torn or corrupt lines are skipped with a warning (a torn
        last line is cut off the file, so that it is named once)."""
        return [e for e in self._entries() if isinstance(e, BankedBatch)]

    def read_partial(self) -> PartialRecords:
        """The partial-rollouts records, parsed (complete groups validated)."""
        records = PartialRecords()
        for entry in self._entries():
            if isinstance(entry, BankedBatch):
                continue
            if "launch" in entry:
                if entry["pending"]:
                    records.launches.append(Launch(entry["launch"], entry["before"]))
                    records.pending += entry["pending"]
                records.agent_state = entry["agents"]
                records.next_index = max(entry["launch"]) + 1
            elif "group" in entry:
                records.groups[entry["group"]] = RolloutGroup.model_validate(entry["rollouts"])
            elif "redo" in entry:
                for index in entry["redo"]:
                    records.groups.pop(index, None)
            elif "batch" in entry:
                records.batches[entry["batch"]] = list(entry["indices"])
        return records

    def _entries(self) -> list[Entry]:
        with _ACCESS:
            if not self.path.exists():
                return []
            entries = read_jsonl(self.path, _parse, skip_bad_lines=True)
            if not ends_with_newline(self.path):  # torn by a crash mid-append, and named just now
                self._rewrite(entries)
            return entries

    def _append(self, line: str) -> None:
        with _ACCESS:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not ends_with_newline(self.path):
                self._entries()  # cuts the torn line off
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()

    def pending(self, trained_step: int) -> list[BankedBatch]:
        """The banked batches for steps trained_step+1, trained_step+2, ... without a gap."""
        return _pending(self.read(), trained_step)

    def compact(self, trained_step: int) -> None:
        """Keep only what steps after `trained_step` train on (called once that step is checkpointed):
        their batches, and the partial-rollouts records of groups no step up to it took."""
        with _ACCESS:
            if not self.path.exists():
                return
            entries = self._entries()
            pending = {
                id(b) for b in _pending([e for e in entries if isinstance(e, BankedBatch)], trained_step)
            }
            done = {
                index
                for e in entries
                if isinstance(e, dict) and "batch" in e and e["batch"] <= trained_step
                for index in e["indices"]
            }
            launches = [e for e in entries if isinstance(e, dict) and "launch" in e]
            kept: list[Entry] = []
            for e in entries:
                if isinstance(e, BankedBatch):
                    if id(e) in pending:
                        kept.append(e)
                elif "launch" in e:
                    undone = [i for i in e["pending"] if i not in done]
                    if undone or e is launches[-1]:  # the newest keeps the agents' state
                        kept.append(e | {"pending": undone})
                elif _partial_kept(e, trained_step, done):
                    kept.append(e)
            self._rewrite(kept)

    def _rewrite(self, entries: list[Entry]) -> None:
        atomic_write(
            self.path, "".join(e.to_line() if isinstance(e, BankedBatch) else _line(e) for e in entries)
        )


def _pending(batches: list[BankedBatch], trained_step: int) -> list[BankedBatch]:
    """Of `batches`, those for steps trained_step+1, trained_step+2, ... without a gap."""
    by_step = {b.step: b for b in batches if b.step > trained_step}
    found = []
    step = trained_step + 1
    while step in by_step:
        found.append(by_step[step])
        step += 1
    return found


def _partial_kept(record: dict[str, Any], trained_step: int, done: set[int]) -> bool:
    """Whether a checkpoint of `trained_step` keeps `record`; `done`: the groups trained by then."""
    if "batch" in record:
        return record["batch"] > trained_step
    if "redo" in record:
        return not done.issuperset(record["redo"])
    return record["group"] not in done


def _line(record: dict[str, Any]) -> str:
    payload = _canonical(record)
    return f'{{"crc32":{zlib.crc32(payload.encode())},"record":{payload}}}\n'


def _canonical(record: dict[str, Any]) -> str:
    """The JSON the checksum covers: keys sorted, no spaces, so a record re-serialises identically."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _parse(entry: dict[str, Any]) -> Entry:
    """One bank line's batch, or its partial-rollouts record as it is; a `ValueError` when its checksum
    does not match its record."""
    record = entry["record"]
    if zlib.crc32(_canonical(record).encode()) != entry["crc32"]:
        raise ValueError("checksum mismatch")
    if not _PARTIAL_KINDS.isdisjoint(record):
        return record
    groups = [RolloutGroup.model_validate(g) for g in record["groups"]]
    return BankedBatch(step=int(record["step"]), groups=groups, agent_state=record["agents"])
