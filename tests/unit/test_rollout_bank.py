"""The rollout bank: checksummed records, torn or corrupt lines skipped, pending batches, compaction."""

from __future__ import annotations

import logging

from llmrl.rollouts import BANK_FILE, BankedBatch, RolloutBank
from llmrl.types import RolloutGroup, TokenRollout


def batch(step: int) -> BankedBatch:
    rollout = TokenRollout(
        trajectory=[[1, 2], [3, 4]],
        generation_mask=[[False, False], [True, True]],
        logprobs=[[0.0, 0.0], [-0.1, -0.7]],
        reward=0.5,
        env_id="env",
        problem_id=f"p{step}",
        policy_version=step - 1,
    )
    return BankedBatch(
        step=step,
        groups=[RolloutGroup(group_id=f"env/{step}", rollouts=[rollout])],
        agent_state={"env": {"drawn": step}},
    )


def test_batches_round_trip_exactly(tmp_path):
    bank = RolloutBank(tmp_path)
    for step in (1, 2, 3):
        bank.append(batch(step))
    read = bank.read()
    assert [b.step for b in read] == [1, 2, 3]
    assert read[1].groups == batch(2).groups and read[1].agent_state == {"env": {"drawn": 2}}


def test_pending_is_contiguous_after_the_trained_step(tmp_path):
    bank = RolloutBank(tmp_path)
    for step in (1, 2, 3, 5):
        bank.append(batch(step))
    assert [b.step for b in bank.pending(1)] == [2, 3]  # 5 is after a gap: never trained out of order
    assert bank.pending(3) == [] and RolloutBank(tmp_path / "empty").pending(0) == []


def test_a_torn_last_line_is_skipped_and_cut_before_the_next_append(tmp_path, caplog):
    bank = RolloutBank(tmp_path)
    bank.append(batch(1))
    bank.append(batch(2))
    path = tmp_path / BANK_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # killed in the middle of writing record 2
    with caplog.at_level(logging.WARNING):
        assert [b.step for b in bank.read()] == [1]
    assert "skipped a torn line" in caplog.text
    bank.append(batch(2))
    assert [b.step for b in bank.read()] == [1, 2]
    assert path.read_text().count("\n") == 2


def test_a_torn_last_line_is_named_once_however_the_resumed_run_goes_on(tmp_path, caplog):
    for then in ("append", "compact"):  # a new batch first, or a checkpoint of a banked one
        run = tmp_path / then
        bank = RolloutBank(run)
        bank.append(batch(1))
        bank.append(batch(2))
        path = run / BANK_FILE
        path.write_bytes(path.read_bytes()[:-40])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert [b.step for b in bank.pending(0)] == [1]  # the resume's read
            if then == "append":
                bank.append(batch(2))
            else:
                bank.compact(1)
            bank.read()
        torn = [r.getMessage() for r in caplog.records if "skipped a torn line" in r.getMessage()]
        assert len(torn) == 1 and torn[0].startswith(f"{path}:2: "), (then, torn)


def test_a_corrupt_record_fails_its_checksum_and_is_never_loaded(tmp_path):
    bank = RolloutBank(tmp_path)
    bank.append(batch(1))
    bank.append(batch(2))
    path = tmp_path / BANK_FILE
    first, second = path.read_text().splitlines(keepends=True)
    path.write_text(first.replace('"reward":0.5', '"reward":1.0') + second)  # valid JSON, wrong content
    assert [b.step for b in bank.read()] == [2]
    assert bank.pending(0) == []  # step 1 is missing, so nothing follows it either


def test_compact_keeps_only_untrained_batches(tmp_path):
    bank = RolloutBank(tmp_path)
    for step in (1, 2, 3):
        bank.append(batch(step))
    bank.compact(2)
    assert [b.step for b in bank.read()] == [3]
