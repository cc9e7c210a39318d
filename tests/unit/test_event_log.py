"""The coordinator's event history (gpumesh/coordinator/events.py): packed, in order, bounded."""

from __future__ import annotations

import gc

from gpumesh.coordinator.events import Event, EventLog


def _fill(log: EventLog, count: int, start: int = 1) -> None:
    for seq in range(start, start + count):
        log.append(Event(seq, 1000.0 + seq, "task_finished",
                         {"task": f"t{seq:06d}", "latency": seq / 1000, "state": "done"}))


def test_events_come_back_in_order_from_a_sequence_number_on():
    log = EventLog(history=50, segment=10)
    _fill(log, 25)
    assert [e.seq for e in log.since(17)] == list(range(18, 26))
    back = list(log)[3]
    assert back == Event(4, 1004.0, "task_finished", {"task": "t000004", "latency": 0.004,
                                                      "state": "done"})
    assert log[-1].seq == log.last_seq == 25 and len(log) == 25


def test_the_oldest_segment_goes_whole_once_the_history_is_full():
    log = EventLog(history=50, segment=10)
    _fill(log, 95)
    seqs = [e.seq for e in log]
    assert seqs == list(range(41, 96))  # at least 50 kept, at most one segment more
    assert [e.seq for e in log.since(0)] == seqs and log.last_seq == 95


def test_an_empty_log_says_so():
    log = EventLog()
    assert list(log) == [] and len(log) == 0 and log.last_seq == 0


def test_ten_thousand_events_are_a_few_objects_not_ten_thousand():
    # Objects made one by one over a burst pin the pymalloc arenas they landed in.
    log = EventLog()
    gc.collect()
    before = len(gc.get_objects())
    _fill(log, 10_000)
    gc.collect()
    assert len(gc.get_objects()) - before < 100
