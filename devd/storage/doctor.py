"""What `devd doctor` finds, one `Check` a line: the daemon's, the state directory's and each store backend's checks
(`sqlite_doctor`, `postgres_doctor`) all say it this way."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Check", "size"]


class Check(msgspec.Struct, frozen=True):
    """One check of `devd doctor`: `ok`, `FAIL` (what is wrong and what to do), or `skip` (it could not be made
    now, and why: not a failure)."""

    name: str
    outcome: Literal["ok", "FAIL", "skip"]
    says: str

    def line(self) -> str:
        """One line, whatever it says (wasmtime's and PostgreSQL's errors span several)."""
        return f"{self.outcome:<4}  {self.name}: {' '.join(self.says.split())}"


def size(n: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1 of it: 512 B, 4.0 KiB, 61.6 MiB, 1.5 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
