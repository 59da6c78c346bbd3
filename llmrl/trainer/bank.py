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
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrl.files import atomic_write
from llmrl.telemetry import ends_with_newline, read_jsonl
from llmrl.types import RolloutGroup

BANK_FILE = "rollout_bank.jsonl"


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
        payload = _canonical(record)
        return f'{{"crc32":{zlib.crc32(payload.encode())},"record":{payload}}}\n'


class RolloutBank:
    """Append-only store of generated batches in a run folder (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / BANK_FILE

    def append(self, batch: BankedBatch) -> None:
        """Write one batch as one flushed line (a torn line from an earlier crash is cut off first)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not ends_with_newline(self.path):
            self._rewrite(self.read())
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(batch.to_line())
            handle.flush()

    def read(self) -> list[BankedBatch]:
        """Every intact batch, in file order; torn or corrupt lines are skipped with a warning."""
        if not self.path.exists():
            return []
        return read_jsonl(self.path, _parse, skip_bad_lines=True)

    def pending(self, trained_step: int) -> list[BankedBatch]:
        """The banked batches for steps trained_step+1, trained_step+2, ... without a gap."""
        by_step = {b.step: b for b in self.read() if b.step > trained_step}
        found = []
        step = trained_step + 1
        while step in by_step:
            found.append(by_step[step])
            step += 1
        return found

    def compact(self, trained_step: int) -> None:
        """Keep only the batches for steps after `trained_step` (called once that step is checkpointed)."""
        if self.path.exists():
            self._rewrite(self.pending(trained_step))

    def _rewrite(self, batches: list[BankedBatch]) -> None:
        atomic_write(self.path, "".join(b.to_line() for b in batches))


def _canonical(record: dict[str, Any]) -> str:
    """The JSON the checksum covers: keys sorted, no spaces, so a record re-serialises identically."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _parse(entry: dict[str, Any]) -> BankedBatch:
    """One bank line's batch; a `ValueError` when its checksum does not match its record."""
    record = entry["record"]
    if zlib.crc32(_canonical(record).encode()) != entry["crc32"]:
        raise ValueError("checksum mismatch")
    groups = [RolloutGroup.model_validate(g) for g in record["groups"]]
    return BankedBatch(step=int(record["step"]), groups=groups, agent_state=record["agents"])
