"""Stop signals acted on outside the signal handler.

A Python signal handler runs in the main thread between two of its bytecodes, wherever that
thread is: inside ``threading.Event.set()`` called by an earlier signal's handler, or holding a
lock the handler's work needs. A handler that takes a lock can then wait for itself forever.
`make dev` hung that way when ``make`` and the ``kill`` that stopped it both sent it SIGTERM: the
second handler's ``Event.set()`` waited for the condition lock the first one held (seen with
py-spy: two handler frames on the main thread's stack, the inner one in ``Condition.__enter__``).

Here the handler only puts the signal's number on a :class:`queue.SimpleQueue`, whose ``put`` the
Python documentation says is reentrant ("a put() or get() call can be interrupted by another put()
call in the same thread without deadlocking"), and a thread of its own calls ``on_signal`` with
it, where taking locks is safe.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # HUP: a closed terminal


def handle_signals(signums: Iterable[signal.Signals], on_signal: Callable[[int], None]) -> Callable[[], None]:
    """Call ``on_signal(signum)`` from a thread of its own for each of ``signums`` received
    (from the main thread only, as :func:`signal.signal`). Returns what puts the previous
    handlers back and ends that thread."""
    received: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def handler(signum: int, frame: FrameType | None) -> None:
        received.put(signum)  # nothing else here: see the module's docstring

    def relay() -> None:
        while (signum := received.get()) is not None:
            try:
                on_signal(signum)
            except Exception:  # the next signal must still be acted on
                logging.getLogger("catacloud").exception("acting on signal %s", signum)

    threading.Thread(target=relay, name="signals", daemon=True).start()
    previous: dict[signal.Signals, Any] = {signum: signal.signal(signum, handler) for signum in signums}

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)
        received.put(None)

    return restore
