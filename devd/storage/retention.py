"""What a SQL store keeps of a session's history, decided once for every backend: pure, no database.

A store promises watchers the `steps_kept` steps behind a session's latest snapshot and retries the answers of its
`keys_kept` newest keys. What derives the steps promised is the newest snapshot before the oldest of them (the
anchor; without one, the session's start): from it on every row and snapshot stays. Before it, rows without a key go,
and keyed rows beyond the `keys_kept` newest keys (an answer not kept whole among those left can no longer be
derived). Pruning runs every `prune_every_steps` of a session's steps; thinning (SQLite's, for the snapshots it keeps
in files) after each snapshot: of the snapshots strictly between the anchor and the latest only the oldest stays,
the next anchor once the kept window passes it. So a session keeps at most three snapshots, none larger than its
latest, and a fork or a retry's answer from inside the window replays from the one before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Plan", "Retention"]


class Plan(msgspec.Struct, frozen=True):
    """What one session keeps, decided at its latest snapshot."""

    anchor: int | None  # the snapshot every kept step derives from; None: the start (nothing can be pruned)
    thinned: list[int]  # the seqs of the snapshots that go (their rows stay)


class Retention(msgspec.Struct, frozen=True):
    keys_kept: int
    steps_kept: int
    prune_every_steps: int

    def due(self, seq: int, pruned_at: int) -> bool:
        """Whether a session whose latest snapshot is at `seq` and was last pruned at `pruned_at` is pruned now."""
        return seq - pruned_at >= self.prune_every_steps

    def promised_from(self, latest: int) -> int:
        """The oldest step promised behind a snapshot at `latest`."""
        return latest - self.steps_kept + 1

    def plan(self, snapshots: Sequence[int], latest: int) -> Plan:
        """What to keep, given the seqs of the session's snapshots at or before `latest` (its latest), ascending."""
        promised = self.promised_from(latest)
        before = [seq for seq in snapshots if seq < promised]
        anchor = before[-1] if before else None
        between = [seq for seq in snapshots if (anchor or 0) < seq <= latest]
        thinned = between[1:-1] if len(between) >= 3 and between[-1] == latest else []
        return Plan(anchor, thinned)

    @property
    def keys_offset(self) -> int:
        """How many keyed rows are newer than the oldest key kept."""
        return self.keys_kept - 1
