"""A result one message cannot carry becomes an error that says so, in the runner, before it is
written to the agent (tests/integration/test_oversize_messages.py runs it on a mesh)."""

from __future__ import annotations

from gpumesh.config import Limits, sizes_over_room
from gpumesh.runner.execute import RESULT_ROOM_BYTES, RESULT_ROOM_FRAMES, fit_to_send

SLICE = Limits().chunk_bytes  # a bigger frame travels as slices of this size


def test_a_result_that_fits_goes_as_it_is():
    header, frames = {"status": "ok"}, [b"pickle", bytearray(1000)]
    assert fit_to_send(header, frames) == (header, frames)
    assert fit_to_send(header, frames)[1] is frames  # no copy on every task's way out


def test_the_room_is_a_message_less_its_header():
    limits = Limits()
    assert limits.max_message_bytes - limits.max_header_bytes == RESULT_ROOM_BYTES
    assert limits.max_frames - 3 == RESULT_ROOM_FRAMES


def test_a_result_over_the_byte_room_is_refused_with_both_sizes():
    header, frames = fit_to_send({"status": "ok"}, [b"p", bytearray(3 << 20)], room_bytes=2 << 20)
    assert frames == []
    assert header["status"] == "error"
    assert header["error"]["type"] == "gpumesh.ResultTooLarge"
    assert "3.0 MiB pickled" in header["error"]["message"]
    assert "at most 2.0 MiB" in header["error"]["message"]


def test_frames_are_counted_as_the_slices_they_travel_in():
    big = bytearray(2 * SLICE + 1)  # three slices on the wire
    assert fit_to_send({"status": "ok"}, [b"p", big], room_frames=4)[1] == [b"p", big]
    header, frames = fit_to_send({"status": "ok"}, [b"p", big], room_frames=3)
    assert frames == [] and "4 frames pickled" in header["error"]["message"]
    assert "at most 3" in header["error"]["message"]


def test_sizes_over_a_room_never_read_alike():
    mib = 1024 * 1024
    assert sizes_over_room(1100 * mib, 1023 * mib) == ("1,100.0 MiB", "1,023.0 MiB")
    assert sizes_over_room(1023 * mib + 1, 1023 * mib) == ("1,072,693,249 bytes",
                                                            "1,072,693,248 bytes")


def test_an_error_the_worker_reported_reads_without_an_empty_traceback():
    from gpumesh.errors import RemoteError

    refused = RemoteError("it is too big", remote_type="gpumesh.ResultTooLarge",
                          remote_traceback="")
    assert str(refused) == "gpumesh.ResultTooLarge: it is too big"
    raised = RemoteError("boom", remote_type="ValueError", remote_traceback="Traceback ...")
    assert str(raised).endswith("Remote traceback:\nTraceback ...")


def test_a_shared_frame_counts_at_its_size_and_in_its_slices():
    from gpumesh.protocol.serialize import wire_cost

    frames = [b"p" * 10, b""]  # a pickle and the placeholder of a frame in shared memory
    assert wire_cost(frames, SLICE) == (10, 2)
    assert wire_cost(frames, SLICE, [(1, "a" * 32, 3 * SLICE)]) == (10 + 3 * SLICE, 4)


def test_a_result_the_full_shared_folder_could_not_take_is_crashed_not_too_large(
        tmp_path, monkeypatch):
    # /dev/shm full (a container's 64 MiB): the big result stayed in the message, over its
    # room, and the task failed for good as told to "return less", though the cause passes.
    from gpumesh.runner import __main__ as runner_main
    from gpumesh.sharedmem import MIN_SHARED_BYTES

    class FullFolder:
        path = tmp_path

    big = bytearray(MIN_SHARED_BYTES)
    monkeypatch.setattr(runner_main, "fit_to_send",
                        lambda header, frames: ({"status": "error", "error": {
                            "type": "gpumesh.ResultTooLarge",
                            "message": "the task's result was not sent: it is 2 GiB"}}, []))
    header, frames = runner_main._fit({"status": "ok"}, [b"pickle", big], FullFolder())
    assert header["status"] == "crashed" and frames == []
    assert "shared-memory folder" in header["diagnosis"] and "MiB free" in header["diagnosis"]
    # Too big with no folder to blame (another machine, or only small frames): as before.
    header, _ = runner_main._fit({"status": "ok"}, [b"pickle", big], None)
    assert header["error"]["type"] == "gpumesh.ResultTooLarge"
    header, _ = runner_main._fit({"status": "ok"}, [b"pickle"] * 3, FullFolder())
    assert header["error"]["type"] == "gpumesh.ResultTooLarge"
    # An error's pickled exception never goes to the folder: its size is its own, not the
    # folder's fault (retried as crashed, it would run again up to max_attempts).
    header, _ = runner_main._fit({"status": "error", "error": {}}, [b"pickle", big],
                                 FullFolder())
    assert header["error"]["type"] == "gpumesh.ResultTooLarge"
