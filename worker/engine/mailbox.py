"""What other threads hand the engine thread: admitted sequences, commands, and the one event that
wakes the loop.

Any thread may ``submit`` a sequence, ``post`` a command (a policy to adopt on the engine thread)
or ``wake`` the loop (a cancel flag was set, a reload was offered to ``Control``). Only the engine
thread runs the commands, takes the sequences and sleeps. A deque's append and popleft and a
SimpleQueue are safe across threads without a lock of their own.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from graphkeeper.worker.engine.sequence import Sequence


class Mailbox:
    def __init__(self) -> None:
        self._inbox: deque[Sequence] = deque()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()

    def __len__(self) -> int:
        """Sequences submitted and not taken by the engine thread yet."""
        return len(self._inbox)

    # --- any thread -----------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self._inbox.append(seq)
        self._wake.set()

    def post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # --- the engine thread ----------------------------------------------------------------

    def has_commands(self) -> bool:
        """Whether a command waits (a sleeping engine wakes for it)."""
        return not self._commands.empty()

    def run_commands(self) -> None:
        while not self._commands.empty():
            self._commands.get_nowait()()

    def take(self) -> list[Sequence]:
        """The sequences submitted so far, in order, handed over once."""
        taken = []
        while self._inbox:
            taken.append(self._inbox.popleft())
        return taken

    def sleep(self, timeout: float) -> None:
        """Waits at most ``timeout`` seconds for a wake-up (one that came since the last sleep ends
        this one at once)."""
        self._wake.wait(timeout)
        self._wake.clear()
