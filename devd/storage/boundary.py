"""Where a backend's driver exceptions become devd's, in the manner of httpcore's `map_exceptions`.

Each SQL store names, once, what its driver and the file system raise (its faults), and wraps every call that can
raise them in `map_exceptions`: inside, a fault becomes StoreError saying what failed and what to do; outside, no
driver exception is ever seen (`devd.storage.store` promises it). Faults a store handles itself (a failed prune, a
checkpoint, a file it could not remove: logged, and the store goes on) are caught where they are handled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from devd.errors import StoreError

__all__ = ["map_exceptions"]

E = TypeVar("E", bound=BaseException)


@contextmanager
def map_exceptions(faults: tuple[type[E], ...], say: Callable[[E], str]) -> Iterator[None]:
    """Run the block; a fault of `faults` it raises is raised as StoreError(say(fault)) instead, from nothing (the
    driver's traceback says nothing to whoever reads the error)."""
    try:
        yield
    except faults as e:
        raise StoreError(say(e)) from None
