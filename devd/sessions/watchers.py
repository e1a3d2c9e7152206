"""Watcher fan-out: who watches which session, and delivering each answered step to them without waiting.

The registry publishes domain events (`Stepped`, `Unwatched`); the wire layer hands in `encode`, so each event is
encoded once, however many watch it, and this module never sees the wire format. A sink's `offer` must not block:
the stepping client never waits for a watcher. A watcher that cannot take a notice is dropped with exactly one
`Unwatched` (forced through), and gets nothing more on that subscription.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec


class Stepped(msgspec.Struct, frozen=True):
    session: str
    seq: int
    event: bytes
    actions: bytes
    at: float  # wall-clock seconds: when the step was answered (journalled, for a step of the history)


class Unwatched(msgspec.Struct, frozen=True):
    session: str
    seq: int  # the last step the watcher was sent
    reason: str
    owner: tuple[str, str] | None = None  # (node, address) of the daemon that now holds a session that moved


Notice = Stepped | Unwatched


class Sink(Protocol):
    def offer(self, data: bytes) -> bool:
        """Queue data if there is room for it; never blocks."""

    def force(self, data: bytes) -> None:
        """Queue data whatever the room (for the one notice that ends a subscription)."""


class Subscription(msgspec.Struct, eq=False):
    session: str
    sink: Sink
    last_seq: int
    catching_up: bool = False  # history is still being sent from the journal: live steps wait their turn
    active: bool = True


class Fanout(msgspec.Struct):
    encode: Callable[[Notice], bytes]
    _by_session: dict[str, set[Subscription]] = msgspec.field(default_factory=dict)

    def subscribe(self, session: str, sink: Sink, last_seq: int, *, catching_up: bool) -> Subscription:
        sub = Subscription(session, sink, last_seq, catching_up)
        self._by_session.setdefault(session, set()).add(sub)
        if not catching_up:
            self.live(sub)
        return sub

    def caught_up(self, sub: Subscription) -> None:
        """sub has been sent the history it asked for: live steps go to it from now on."""
        sub.catching_up = False
        self.live(sub)

    def live(self, sub: Subscription) -> None:
        """sub has begun to receive live notices (a subclass sends what a late watcher needs to make sense of them)."""

    def unsubscribe(self, sub: Subscription) -> None:
        sub.active = False
        subs = self._by_session.get(sub.session)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_session[sub.session]

    def count(self, session: str) -> int:
        return len(self._by_session.get(session, ()))

    def watched(self) -> list[str]:
        """The sessions with a subscriber (as many as are watched, not as many as there are)."""
        return list(self._by_session)

    def publish(self, stepped: Stepped) -> None:
        subs = self._by_session.get(stepped.session)
        if not subs:
            return
        data = self.encode(stepped)
        for sub in list(subs):
            if not sub.catching_up:
                self.deliver(sub, stepped.seq, data)

    def deliver(self, sub: Subscription, seq: int, data: bytes) -> bool:
        """Send one step's notice (already encoded) unless it was sent; False once the subscription has ended."""
        if not sub.active:
            return False
        if seq <= sub.last_seq:
            return True
        if sub.sink.offer(data):
            sub.last_seq = seq
            return True
        self.end_one(sub, "fell too far behind")
        return False

    def end_one(self, sub: Subscription, reason: str, owner: tuple[str, str] | None = None) -> None:
        self.unsubscribe(sub)
        sub.sink.force(self.encode(Unwatched(sub.session, sub.last_seq, reason, owner)))

    def rewound(self, session: str, at: int) -> None:
        """The session went back to step `at` (`session/rewind`): every subscription ends as having seen up to `at`
        at most, so that watching again from the notice's `seq` tells the steps that replace those after it."""
        for sub in list(self._by_session.get(session, ())):
            sub.last_seq = min(sub.last_seq, at)
        self.end(session, f"rewound to step {at}")

    def end(self, session: str, reason: str, owner: tuple[str, str] | None = None) -> None:
        """Every subscription to session ends (it was closed, expired, or moved to the daemon `owner`)."""
        self.stopped(session, reason, owner)

    def stopped(self, session: str, reason: str, owner: tuple[str, str] | None = None) -> None:
        """Every subscription to session ends, told `reason`; the session itself is not gone (`end` says it is): one
        that ended or was poisoned under its running turn is kept until `recover`, and is watched again from `seq`."""
        for sub in list(self._by_session.get(session, ())):
            self.end_one(sub, reason, owner)
