"""The public API is a hand-picked list; adding or removing a name is a deliberate act."""

from pathlib import Path

import gpumesh

EXPECTED = {
    "GPUMesh", "MeshExecutor", "MeshFunction", "TaskFuture", "TaskOptions", "accelerate", "mesh",
    "AuthenticationError", "ConfigError", "ConnectionFailed", "MeshError", "MeshTimeout", "ProtocolMismatch",
    "RemoteError", "RunnerCrashed", "SubmitRejected", "TaskCancelled", "TaskError", "TaskTimeout",
    "Unschedulable", "__version__",
}


def test_all_is_the_hand_picked_surface():
    assert set(gpumesh.__all__) == EXPECTED


def test_every_public_name_resolves():
    for name in gpumesh.__all__:
        assert getattr(gpumesh, name) is not None


def test_errors_share_one_root():
    for name in EXPECTED - {"GPUMesh", "MeshExecutor", "MeshFunction", "TaskFuture", "TaskOptions", "accelerate",
                            "mesh", "__version__"}:
        assert issubclass(getattr(gpumesh, name), gpumesh.MeshError)


def test_the_package_says_it_is_typed():
    # PEP 561: without the marker, type checkers ignore the annotations of an installed gpumesh.
    assert (Path(gpumesh.__file__).parent / "py.typed").is_file()


def test_gather_countdown_wakes_on_the_last_result_or_the_first_failure():
    import concurrent.futures

    from gpumesh.client.api import _Countdown

    futures = [concurrent.futures.Future() for _ in range(3)]
    watch = _Countdown(futures)
    futures[0].set_result(1)
    futures[2].set_result(3)
    assert not watch.changed.is_set() and not watch.finished
    futures[1].set_result(2)
    assert watch.changed.is_set() and watch.finished and not watch.failed
    failing = [concurrent.futures.Future() for _ in range(3)]
    watch = _Countdown(failing)
    failing[1].set_exception(ValueError("boom"))
    assert watch.changed.is_set() and watch.failed and not watch.finished
    cancelled = [concurrent.futures.Future()]
    watch = _Countdown(cancelled)
    cancelled[0].cancel()
    assert watch.failed
    assert _Countdown([]).changed.is_set()


def test_a_coordinator_name_that_does_not_resolve_is_said_to_be_so(monkeypatch):
    # ZeroMQ reports a name it cannot look up as a refused connection: "nothing is listening
    # there" sent the user after a coordinator instead of the typo. (No lookup leaves this
    # machine here: getaddrinfo is replaced.)
    import socket

    from gpumesh.client import api

    def no_such_name(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(api.socket, "getaddrinfo", no_such_name)
    assert "does not resolve (Name or service not known)" in api._unresolved("gpu-boxx")
    assert api._unresolved("192.0.2.7") == "" and api._unresolved("::1") == ""
    monkeypatch.setattr(api.socket, "getaddrinfo", lambda *a, **k: [])
    assert api._unresolved("gpu-box") == ""
