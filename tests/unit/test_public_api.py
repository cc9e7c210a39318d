"""The public API is a hand-picked list; adding or removing a name is a deliberate act."""

from pathlib import Path

import gpumesh

EXPECTED = {
    "GPUMesh", "MeshExecutor", "MeshFunction", "TaskFuture", "TaskOptions", "accelerate", "mesh",
    "AuthenticationError", "ConfigError", "ConnectionFailed", "MeshError", "MeshTimeout", "ProtocolMismatch",
    "RemoteError", "RunnerCrashed", "SubmitRejected", "TaskError", "TaskTimeout",
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
