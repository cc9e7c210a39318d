"""Turning functions, arguments and results into frames and back (pickle protocol 5).

Buffers of 64 KiB or more that pickle hands over as PickleBuffers (numpy arrays, torch CPU
tensors) leave the pickle stream as out-of-band frames, so they are sent and received without a
copy. Smaller ones stay in-band, where copying is cheaper than the bookkeeping. cloudpickle is used because user functions and
classes usually live in ``__main__``, which stdlib pickle would send by a name the worker lacks.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import cloudpickle

OUT_OF_BAND_THRESHOLD = 64 * 1024
PROTOCOL = 5


def dumps(obj: Any) -> list[Any]:
    """``[main pickle, buffer, buffer, ...]``; buffers are memoryviews over the object's memory."""
    buffers: list[memoryview] = []

    def keep_large_out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_THRESHOLD:
            return True  # a true value keeps the buffer in-band
        buffers.append(view)
        return False

    main = cloudpickle.dumps(obj, protocol=PROTOCOL, buffer_callback=keep_large_out_of_band)
    return [main, *buffers]


def loads(frames: Sequence[Any]) -> Any:
    """Rebuild an object from ``dumps`` frames (bytes, memoryviews or zmq Frames)."""
    main, *buffers = (_as_buffer(frame) for frame in frames)
    return pickle.loads(main, buffers=buffers)


def _as_buffer(frame: Any) -> Any:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame: a memoryview without a copy
    return buffer if buffer is not None else frame


def function_digest(pickled_function: bytes) -> str:
    """A short content id, so runners unpickle each distinct function once."""
    return hashlib.blake2b(pickled_function, digest_size=12).hexdigest()


def payload_nbytes(frames: Sequence[Any]) -> int:
    total = 0
    for frame in frames:
        total += frame.nbytes if isinstance(frame, memoryview) else len(frame)
    return total
