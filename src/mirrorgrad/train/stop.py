"""Stop requests: how SIGINT and SIGTERM end a run at any moment.

While steps run, a signal sets a flag: the loop finishes the current step, saves a
checkpoint and reports (a second Ctrl-C aborts at once). Anywhere else (setup, data
loading, compiling, the final evaluation) a signal raises KeyboardInterrupt at once,
which the command turns into one line and exit status 130.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.deferred = False  # True while steps run: stop at the next step boundary

    def _handle(self, signum: int, frame: object) -> None:
        if not self.deferred or (self.requested and signum == signal.SIGINT):
            raise KeyboardInterrupt
        if not self.requested:
            print(
                "\nstopping after this step and saving a checkpoint (Ctrl-C again aborts)",
                file=sys.stderr,
            )
        self.requested = True

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handles SIGINT and SIGTERM inside the block (main thread only: elsewhere
        Python cannot catch signals and the handlers are left alone)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # A signal ignored by whoever started us (`cmd &` in a script ignores SIGINT)
        # stays ignored, as Unix programs do.
        previous = {s: signal.getsignal(s) for s in _SIGNALS}
        previous = {s: h for s, h in previous.items() if h is not signal.SIG_IGN}
        for s in previous:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside the block a signal only sets ``requested``."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False
