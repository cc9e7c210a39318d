"""gpumesh.stopflag: a stop request a signal handler may make, twice at once included."""

from __future__ import annotations

import signal
import threading

from gpumesh.stopflag import StopFlag


def test_a_set_made_inside_a_set_returns_as_a_second_signal_handler_must():
    # serve's handler called threading.Event.set: a second SIGTERM whose handler ran inside
    # the first's set() waited on the event's lock for good (pkill matched both `timeout` and
    # serve), and serve never stopped. Here the second set() runs where the first writes.
    flag = StopFlag()
    first = flag._wake
    nested = []

    def second_signal_lands() -> None:
        if not nested:
            nested.append(True)
            flag.set()
        first()

    flag._wake = second_signal_lands  # type: ignore[method-assign]
    done = threading.Event()
    threading.Thread(target=lambda: (flag.set(), done.set()), daemon=True).start()
    assert done.wait(10), "a set() inside a set() did not return"
    assert nested and flag.is_set() and flag.wait(0)
    flag.close()


def test_a_signal_ends_a_wait_at_once_and_sets_stay_harmless():
    flag = StopFlag()
    assert not flag.wait(0.01) and not flag.is_set()
    previous = signal.signal(signal.SIGALRM, lambda *_: flag.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        # No timeout: only the handler's wake can end this wait (pytest-timeout fails a hang),
        # and it returns whether the flag is set.
        assert flag.wait(None)
        assert flag.is_set()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    for _ in range(100_000):  # more than the socket holds: a full socket is no error
        flag.set()
    assert flag.wait(None)
    flag.close()
