"""Ctrl-C during a conversion: held back until the conversion reaches a point where stopping is safe.

A KeyboardInterrupt raised wherever the main thread happens to be can land inside torch's zip writer
(DCP then reports a RuntimeError about the file position, not the interrupt), inside an Orbax save
whose background threads go on writing into a directory that is being removed (they log errors and
leave files behind), or inside the cleanup itself. So while `deferred_interrupts()` is active,
SIGINT only records that it came, and `Interrupts.check()` raises the KeyboardInterrupt at the safe
points the converter chooses: before each box is produced, between the write, the read-back and the
commit. The cleanup after an error then runs to its end, still deferring SIGINT. A SIGINT that
arrives after the last check is raised when the context ends.

Only the main thread receives signals: in another thread, or where SIGINT has a handler other
than Python's default one (someone chose what Ctrl-C does), nothing is changed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Interrupts:
    """Whether a SIGINT came while deferred; `check()` turns it into a KeyboardInterrupt."""

    def __init__(self) -> None:
        self.pending = False

    def record(self, signum: int, frame: object) -> None:
        self.pending = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT came since the last check."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Interrupts]:
    """SIGINT recorded instead of raised while inside (see the module docstring)."""
    interrupts = Interrupts()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield interrupts
        return
    previous = signal.signal(signal.SIGINT, interrupts.record)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupts.check()
