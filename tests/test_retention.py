"""devd.storage.retention: what a session keeps, decided from its snapshots' seqs alone (no database)."""

from __future__ import annotations

from devd.storage.retention import Plan, Retention

KEEP_2 = Retention(keys_kept=2, steps_kept=2, prune_every_steps=1)


def test_the_anchor_is_the_newest_snapshot_before_the_oldest_step_promised() -> None:
    # Steps 7 and 8 are promised behind the snapshot at 8; S4 is the newest before 7.
    assert KEEP_2.plan([4, 8], 8) == Plan(anchor=4, thinned=[])


def test_with_no_snapshot_before_the_steps_promised_nothing_is_pruned() -> None:
    assert KEEP_2.plan([7, 8], 8) == Plan(anchor=None, thinned=[])


def test_of_the_snapshots_between_the_anchor_and_the_latest_only_the_oldest_stays() -> None:
    keep_10 = Retention(keys_kept=1, steps_kept=10, prune_every_steps=1)
    assert keep_10.plan([2, 5, 8, 11, 14], 14) == Plan(anchor=2, thinned=[8, 11])


def test_nothing_is_thinned_unless_the_latest_snapshot_is_the_one_decided_at() -> None:
    keep_10 = Retention(keys_kept=1, steps_kept=10, prune_every_steps=1)
    assert keep_10.plan([5, 8, 11], 12) == Plan(anchor=None, thinned=[])


def test_pruning_is_due_every_prune_every_steps_of_a_session() -> None:
    every_4 = Retention(keys_kept=1, steps_kept=1, prune_every_steps=4)
    assert [every_4.due(seq, pruned_at=8) for seq in (9, 11, 12, 13)] == [False, False, True, True]


def test_the_keys_kept_are_the_oldest_kept_key_and_those_newer() -> None:
    assert (KEEP_2.keys_offset, KEEP_2.promised_from(8)) == (1, 7)
