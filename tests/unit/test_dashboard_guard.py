"""The dashboard's Host rule: the names and the port a request may come by."""

from __future__ import annotations

from gpumesh.dashboard.guard import Guard


def test_a_host_without_a_port_is_the_schemes_default_port():
    # Browsers leave out :443 over HTTPS and :80 over HTTP.
    assert Guard("t", "0.0.0.0", 443, tls=True).host_ok("10.0.0.5")
    assert not Guard("t", "0.0.0.0", 443, tls=True).host_ok("10.0.0.5:80")
    assert Guard("t", "127.0.0.1", 80).host_ok("127.0.0.1")
    assert not Guard("t", "127.0.0.1", 443).host_ok("127.0.0.1")  # plain HTTP on 443
    assert not Guard("t", "0.0.0.0", 8443, tls=True).host_ok("10.0.0.5")


def test_parallel_login_tries_are_each_counted_before_the_token_is_compared():
    # The check and the count took the lock apart: 32 requests at once all passed the check,
    # 32 guesses an address a minute instead of FAILURES_PER_ADDRESS.
    import threading

    from gpumesh.dashboard.guard import FAILURES_PER_ADDRESS

    guard = Guard("the-token", "127.0.0.1", 8265)
    start = threading.Barrier(32)
    outcomes: list[str] = []

    def guess() -> None:
        start.wait()
        outcomes.append(guard.login("10.0.0.9", "a-guess"))

    threads = [threading.Thread(target=guess) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("wrong") == FAILURES_PER_ADDRESS
    assert outcomes.count("blocked") == 32 - FAILURES_PER_ADDRESS
    assert guard.login("10.0.0.9", "the-token") == "blocked"  # the right one waits too
    assert guard.login("10.0.0.10", "the-token") == "ok"  # another address is not held up
    assert guard.login("10.0.0.10", "x") == "wrong"  # and a right try counted nothing there
