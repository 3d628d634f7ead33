"""SIGTERM and SIGHUP as a clean exit: what every command runs under (see :func:`stop_on_signals`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["CLEANUP_DEADLINE_S", "STOP_SIGNALS", "Stopped", "deferred_stop", "stop_on_signals"]


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived: unwind like an interrupt, so every ``with`` and ``finally``
    on the way out runs (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: the signals a service manager stops a process with (systemd, Docker and Kubernetes send
#: SIGTERM; a closed terminal or session sends SIGHUP)
STOP_SIGNALS = ("SIGTERM", "SIGHUP")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While a command runs, SIGTERM and SIGHUP become a normal exit that cleans up.

    By default either kills the process outright: the CPU tier's region (the tier's whole
    capacity, holding users' KV data) stays in ``/dev/shm`` and ``kvtier replay``'s temporary
    store in the user's cache folder. Here the first one raises :class:`Stopped` in the main
    thread, which unwinds through the stack's shutdown and the temporary directories; later
    ones are ignored until that is done, so they cannot cut the clean-up short. Outside the
    main thread (signals cannot be caught there) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    deadlines: list[threading.Timer] = []

    def stop(signum: int, frame: object) -> None:
        for number in numbers:
            signal.signal(number, signal.SIG_IGN)
        # the clean-up gets a deadline: should it hang, the process still ends
        deadline = threading.Timer(CLEANUP_DEADLINE_S, _give_up, (signum,))
        deadline.daemon = True
        deadline.start()
        deadlines.append(deadline)
        if _deferring:
            _deferred.append(signum)  # raised when the step that must not be cut ends
            return
        raise Stopped(signum)

    previous = {number: signal.signal(number, stop) for number in numbers}
    try:
        yield
    finally:
        for deadline in deadlines:
            deadline.cancel()
        for number, handler in previous.items():
            signal.signal(number, handler)


#: seconds a command has, after a stop signal, to clean up before it exits without finishing
#: (systemd's default stop timeout is 90 s, after which it kills the process outright)
CLEANUP_DEADLINE_S = 60.0


def _give_up(signum: int) -> None:
    sys.stderr.write(
        f"kvtier: the clean-up after {signal.Signals(signum).name} did not end within "
        f"{CLEANUP_DEADLINE_S:.0f} s; exiting without it (a CPU region left behind is swept "
        "at the next start)\n"
    )
    sys.stderr.flush()
    os._exit(128 + signum)


# Main-thread state of deferred_stop (signal handlers run in the main thread only).
_deferring: list[bool] = []
_deferred: list[int] = []


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A step that must not be cut in two (starting a process: cut between its spawn and the
    data written to it, the child starts on nothing and dies with a traceback): a stop signal
    that comes meanwhile raises :class:`Stopped` as the step ends, not inside it. Outside the
    main thread (where no signal handler runs) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if not _deferring and _deferred:
        raise Stopped(_deferred.pop())
