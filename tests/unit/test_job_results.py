"""`gpumesh results`: a script job's outputs read back whole, a page at a time, by anyone on the
mesh; `status` shows each only up to PREVIEW_BYTES, and a detached submit's bigger results
could not be read at all."""

from __future__ import annotations

import json

import msgpack

from gpumesh.client.engine import _with_frames
from gpumesh.config import Limits, Timing
from gpumesh.coordinator import retention
from gpumesh.coordinator.broker import Broker
from gpumesh.coordinator.jobs import PREVIEW_BYTES
from gpumesh.protocol import Command, Message, decode, encode
from gpumesh.protocol.serialize import split_frames
from gpumesh.store import Store

W, C, OTHER = b"worker-routing", b"client-routing", b"another-client"


def msg(command: Command, header: dict, payload: list | None = None) -> Message:
    return decode(encode(command, header, payload or []), Limits())


LIMITS = Limits()


def finished_job(outputs: list[bytes], encoding: str = "json", limits: Limits = LIMITS,
                 status: str = "ok") -> tuple[Broker, str]:
    """A broker whose job ``grid`` ran one script task per output, each finished with it (an
    output over a frame's limit in pieces, as a worker sends it)."""
    b = Broker(Store(":memory:"), Timing(), limits, epoch=1, now=0.0)
    b.handle(W, msg(Command.HELLO, {"role": "worker", "id": "w1", "slots": 8, "credit": 64,
                                    "proto": [1, 1], "info": {"python": "3.11", "cores": 8}}), 0.0)
    for routing, name in ((C, "c1"), (OTHER, "c2")):
        b.handle(routing, msg(Command.HELLO, {"role": "client", "id": name, "proto": [1, 1]}), 0.0)
    specs = [{"seq": s, "nf": 1, "kind": "script", "name": "x.py"} for s in range(len(outputs))]
    b.handle(C, msg(Command.SUBMIT, {"tasks": specs, "job": "j1", "name": "grid"},
                    [b"payload"] * len(outputs)), 0.0)
    left = list(outputs)
    while left:  # a slot's worth at a time (no prefetch): in submission order
        b.outbox.clear()
        b.dispatch(0.5)
        tasks = [m.header for m in (decode(f, Limits()) for _, f in b.outbox)
                 if m.command is Command.TASK]
        assert tasks, "nothing was dispatched"
        b.outbox.clear()
        for header in sorted(tasks, key=lambda h: h["lease"]):
            output = left.pop(0)
            result = {"task": header["task"], "lease": header["lease"], "status": status}
            if status == "ok":
                result["encoding"] = encoding
                pieces, layout = split_frames([output], limits.chunk_bytes)
            else:
                result["error"] = {"type": "gpumesh.ScriptError", "message": output.decode(),
                                   "traceback": ""}
                pieces, layout = [], None
            if layout is not None:
                result["split"] = layout
            b.handle(W, msg(Command.RESULT, result, pieces), 1.0)
    b.outbox.clear()
    return b, "j1"


def ask(b: Broker, job: str, page: int = 0) -> tuple[dict, list]:
    """The REPLY to a results query from the other client: (header, frames)."""
    b.handle(OTHER, msg(Command.QUERY, {"what": "results", "qid": 7, "job": job, "page": page}),
             2.0)
    (reply,) = [decode(f, Limits()) for r, f in b.outbox if r == OTHER]
    b.outbox.clear()
    assert reply.command is Command.REPLY
    return reply.header, reply.payload


def test_an_output_over_the_status_preview_is_read_back_whole_by_anyone_on_the_mesh():
    big = json.dumps({"k": "z" * (PREVIEW_BYTES * 4)}).encode()
    b, job = finished_job([big, b'{"small": 1}'])
    status = b.status(job, 2.0)
    assert [("result" in t) for t in status["tasks"]] == [False, True]  # the preview's limit
    header, frames = ask(b, "grid")  # by name, from a client that did not submit it
    assert "more" not in header
    data = _with_frames(header["data"], frames)
    assert [t["state"] for t in data["tasks"]] == ["done", "done"]
    assert [json.loads(t["raw"]) for t in data["tasks"]] == [json.loads(big), {"small": 1}]
    assert data["tasks"][0]["bytes"] == len(big) and data["collected"] == 0


def test_results_come_a_page_at_a_time_and_the_pages_cover_every_task(monkeypatch):
    monkeypatch.setattr(retention, "RESULTS_PAGE_BYTES", 2500)
    outputs = [json.dumps([i] * 400).encode() for i in range(5)]  # about 1.2 KB each
    b, job = finished_job(outputs)
    got, page = [], 0
    while True:
        header, frames = ask(b, job, page)
        data = _with_frames(header["data"], frames)
        assert 1 <= len(data["tasks"]) <= 2 and len(frames) == len(data["tasks"])
        got += [json.loads(t["raw"]) for t in data["tasks"]]
        if "more" not in header:
            break
        page = header["more"]
    assert got == [[i] * 400 for i in range(5)]


def test_an_output_too_big_to_read_back_is_named_with_its_size_and_what_to_do(monkeypatch):
    monkeypatch.setattr(retention, "RESULT_READ_MAX", 100)
    b, job = finished_job([b'"' + b"x" * 200 + b'"', b'"ok"'])
    header, frames = ask(b, job)
    first, second = header["data"]["tasks"]
    assert "frame" not in first and "202 bytes" in first["note"] and "file" in first["note"]
    assert _with_frames(header["data"], frames)["tasks"][1]["raw"] == b'"ok"'


def test_an_unknown_job_and_a_missing_job_are_answered_not_dropped():
    b, _ = finished_job([b"1"])
    header, frames = ask(b, "nope")
    assert "error" in header["data"] and frames == []
    b.handle(OTHER, msg(Command.QUERY, {"what": "results", "qid": 8}), 2.0)
    (reply,) = [decode(f, Limits()) for r, f in b.outbox if r == OTHER]
    assert reply.command is Command.ERROR and reply.header["qid"] == 8


def test_frames_named_by_an_answer_are_attached_and_bad_indexes_name_nothing():
    data = {"tasks": [{"id": "a", "frame": 0}, {"id": "b", "frame": 5}, {"id": "c", "frame": "0"},
                      {"id": "d", "frame": 0, "pieces": 2}, {"id": "e", "frame": 1, "pieces": 9},
                      {"id": "f", "frame": 0, "pieces": 0}, "junk"]}
    out = _with_frames(data, [b"zero", b"one"])
    assert out["tasks"][0] == {"id": "a", "raw": b"zero"}
    assert out["tasks"][1] == {"id": "b"} and out["tasks"][2] == {"id": "c"}
    assert out["tasks"][3] == {"id": "d", "raw": b"zeroone"}
    assert out["tasks"][4] == {"id": "e"} and out["tasks"][5] == {"id": "f"}
    assert _with_frames([1, 2], [b"x"]) == [1, 2]
    assert msgpack.unpackb(msgpack.packb(out["tasks"][0])) == {"id": "a", "raw": b"zero"}


def test_an_output_that_travelled_in_pieces_is_read_back_joined():
    # Over a frame's limit (1 MiB), a worker sends an output in pieces (``split``): such
    # outputs were listed without a word, the very ones `results` was made for.
    big = json.dumps(["y" * 1000] * 2500).encode()  # about 2.5 MB: three pieces
    b, job = finished_job([big])
    header, frames = ask(b, job)
    (entry,) = header["data"]["tasks"]
    assert entry["pieces"] == len(frames) == 3 and entry["bytes"] == len(big)
    assert _with_frames(header["data"], frames)["tasks"][0]["raw"] == big


def test_long_error_texts_keep_each_page_within_the_header_limit():
    # Each failed task's whole message (up to 16 KiB) went into one header for 2,000 tasks:
    # past the 1 MiB limit, the client dropped the REPLY and waited out its timeout.
    limits = Limits(max_header_bytes=32 * 1024)
    b, job = finished_job([("E" * 16_000).encode()] * 60, limits=limits, status="error")
    listed, page, pages = [], 0, 0
    while True:
        header, _ = ask(b, job, page)
        assert len(msgpack.packb(header)) < limits.max_header_bytes
        listed += header["data"]["tasks"]
        pages += 1
        if "more" not in header:
            break
        page = header["more"]
    assert len(listed) == 60 and pages > 1
    assert all(t["state"] == "failed" and len(t["error"]) == 1000 for t in listed)


def test_a_client_that_has_not_taken_its_last_page_is_asked_to_wait():
    b, job = finished_job([b"1"])
    b.outflow.add(OTHER, [[b"a page still going in pieces"]], 2.0)
    b.handle(OTHER, msg(Command.QUERY, {"what": "results", "qid": 9, "job": job}), 2.0)
    (reply,) = [decode(f, Limits()) for r, f in b.outbox if r == OTHER]
    assert reply.command is Command.ERROR and reply.header["code"] == "busy"
