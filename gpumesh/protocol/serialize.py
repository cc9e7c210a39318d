"""Turning functions, arguments and results into frames and back (pickle protocol 5).

Buffers of 64 KiB or more that pickle hands over as PickleBuffers (numpy arrays, torch CPU
tensors) leave the pickle stream as out-of-band frames, so they are sent and received without a
copy. Smaller ones stay in-band, where copying is cheaper than the bookkeeping. ``bytes`` of
that size go out-of-band too, where ``dumps`` finds them (``_BigBytes``; pickle writes them
in-band): 64 MiB of them cost 27-40 ms to pickle on the test machine, and nothing out of band.
cloudpickle is used because user functions and classes usually live in ``__main__``, which
stdlib pickle would send by a name the worker lacks.

torch's own pickling of a tensor writes its storage in-band through ``torch.save``: 0.4 s to
pickle 64 MiB on the test machine, and 0.3 s to read it back. A plain CPU tensor is pickled here
as its bytes in one PickleBuffer instead (``_reduce_tensor``), rebuilt with ``torch.frombuffer``
over the received buffer: no copy either way.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

OUT_OF_BAND_THRESHOLD = 64 * 1024
PROTOCOL = 5


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]  # untyped
    """cloudpickle, with torch CPU tensors as one buffer each."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_tensor(obj)
        if reduced is not None:
            return reduced
        return super().reducer_override(obj)


def dumps(obj: Any) -> list[Any]:
    """``[main pickle, buffer, buffer, ...]``; buffers are memoryviews over the object's memory."""
    if _plain(obj):
        # The same bytes cloudpickle writes for these, without its pickler's set-up: a tiny
        # task's arguments and result, 3.5 -> 1.0 µs each on the test machine.
        return [pickle.dumps(obj, protocol=PROTOCOL)]
    if _holds_big_bytes(obj):
        obj = _wrap_big_bytes(obj, {})
    buffers: list[memoryview] = []

    def keep_large_out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_THRESHOLD:
            return True  # a true value keeps the buffer in-band
        buffers.append(view)
        return False

    with io.BytesIO() as out:
        _Pickler(out, protocol=PROTOCOL, buffer_callback=keep_large_out_of_band).dump(obj)
        main = out.getvalue()
    return [main, *buffers]


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
PLAIN_VALUES = 64  # values looked at before an object counts as not plain (and cloudpickle goes)
# Where ``dumps`` looks for big bytes (``_holds_big_bytes``): BIG_BYTES_VALUES values in all,
# BIG_BYTES_VISITS of them one by one (a container of scalars only is passed over at C speed),
# BIG_BYTES_DEPTH levels down (``(args, kwargs)`` takes two). Past any of these, or at an
# object of another kind, everything stays in-band, as before: a look costs a call that is not
# plain data a few µs at most.
BIG_BYTES_VALUES = 256
BIG_BYTES_VISITS = 16
BIG_BYTES_DEPTH = 6
_SCALARS = frozenset({type(None), bool, int, float, complex, str})


def _plain(obj: Any) -> bool:
    """Whether ``obj`` is only builtin scalars, str and bytes under OUT_OF_BAND_THRESHOLD, in
    tuples, lists and dicts, at most PLAIN_VALUES values in all. The standard pickler writes
    such an object exactly as cloudpickle does (cloudpickle differs only for functions, classes
    and modules; bytes are in-band either way, which is why big ones make an object not plain:
    ``dumps`` sends those out-of-band)."""
    budget = PLAIN_VALUES
    todo = [obj]
    while todo:
        item = todo.pop()
        kind = type(item)
        if kind in _ATOMS:
            if kind is bytes and len(item) >= OUT_OF_BAND_THRESHOLD:
                return False
            continue
        if kind is tuple or kind is list or kind is dict:
            budget -= 2 * len(item) if kind is dict else len(item)
            if budget < 0:
                return False
            todo.extend(item)
            if kind is dict:
                todo.extend(item.values())
            continue
        return False
    return True


class _BigBytes:
    """A ``bytes`` of OUT_OF_BAND_THRESHOLD or more, pickled as one out-of-band buffer. The
    pickler writes bytes in-band before it asks ``reducer_override`` or a dispatch table, so
    they are wrapped in this first (``_wrap_big_bytes``). A bytearray stays in-band: its pickle
    is its copy as it was at the call, which a buffer over it would not be (and the caller
    could not resize it while the task holds the buffer)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return rebuild_bytes, (pickle.PickleBuffer(self.data),)


def rebuild_bytes(buffer: Any) -> bytes:
    """The bytes ``_BigBytes`` pickled: a copy of the frame, whose memory (a message, a mapped
    file) the bytes must not depend on."""
    return bytes(buffer)


def _holds_big_bytes(obj: Any) -> bool:
    """Whether ``obj``, its tuples and lists, and the keys and values of its dicts hold a bytes
    of OUT_OF_BAND_THRESHOLD or more, and nothing but scalars, bytes, bytearrays and arrays of
    plain numbers besides. Any other object may reach a container that ``_wrap_big_bytes``
    copies, and then pickle would send the copy and the original as two objects: then, and
    past the scan's bounds (a list that holds itself), False, and all goes in-band."""
    values, visits = BIG_BYTES_VALUES, BIG_BYTES_VISITS
    found = False
    level = [obj]
    for _ in range(BIG_BYTES_DEPTH):
        visits -= len(level)
        if visits < 0:
            return False
        below: list[Any] = []
        for item in level:
            kind = type(item)
            if kind in _SCALARS or kind is bytearray:
                continue
            if kind is bytes:
                found = found or len(item) >= OUT_OF_BAND_THRESHOLD
                continue
            if kind is dict:
                parts: tuple[Any, ...] = (item, item.values())
            elif kind is tuple or kind is list:
                parts = (item,)
            elif _plain_array(item):
                continue
            else:
                return False
            for part in parts:
                values -= len(part)
                if values < 0:
                    return False
                if not _SCALARS.issuperset(map(type, part)):
                    below.extend(part)
        if not below:
            return found
        level = below
    return False


def _plain_array(obj: Any) -> bool:
    """A numpy array of numbers: its pickle holds its data and nothing else."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(obj) is numpy.ndarray and not obj.dtype.hasobject


def _wrap_big_bytes(obj: Any, copies: dict[int, Any]) -> Any:
    """``obj`` (one ``_holds_big_bytes`` said yes to) with its big bytes in ``_BigBytes``, and
    its tuples, lists and dicts copied, each once (``copies``, by id: what the pickle shares
    stays shared, a dict's key as well as a value)."""
    kind = type(obj)
    if kind is bytes:
        if len(obj) < OUT_OF_BAND_THRESHOLD:
            return obj
    elif kind is not tuple and kind is not list and kind is not dict:
        return obj
    done = copies.get(id(obj))  # obj outlives the call: its id is not reused meanwhile
    if done is not None:
        return done
    copy: Any
    if kind is bytes:
        copy = _BigBytes(obj)
    elif kind is list:
        copy = [_wrap_big_bytes(value, copies) for value in obj]
    elif kind is dict:
        copy = {_wrap_big_bytes(key, copies): _wrap_big_bytes(value, copies)
                for key, value in obj.items()}
    else:
        copy = tuple(_wrap_big_bytes(value, copies) for value in obj)
    copies[id(obj)] = copy
    return copy


def _reduce_tensor(obj: Any) -> tuple[Any, ...] | None:
    """A plain, dense CPU tensor (or Parameter) that owns its whole storage, as
    ``(rebuild_tensor, (its bytes, dtype, shape, requires_grad, is a Parameter))``; None for
    anything else, which pickles as torch pickles it (a view keeps its offset in its storage,
    a transpose its strides, a CUDA tensor its device)."""
    torch = sys.modules.get("torch")
    if torch is None:  # no tensor can exist before torch is imported
        return None
    kind = type(obj)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return None
    try:
        if (obj.device.type != "cpu" or obj.layout is not torch.strided or obj.is_quantized
                or obj.is_conj() or obj.is_neg() or not obj.is_contiguous()
                or obj.storage_offset() != 0 or getattr(obj, "has_names", bool)()
                or obj.untyped_storage().nbytes() != obj.numel() * obj.element_size()):
            return None
        raw = obj.detach().reshape(-1).view(torch.uint8).numpy()  # the same memory, as bytes
    except Exception:  # no numpy here, or a kind of tensor this does not know: torch's way
        return None
    dtype = str(obj.dtype).removeprefix("torch.")
    return rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(obj.shape),
                            bool(obj.requires_grad), kind is torch.nn.Parameter)


def rebuild_tensor(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool,
                   parameter: bool) -> Any:
    """The tensor ``_reduce_tensor`` pickled, over ``buffer`` (copied only if read-only: a
    tensor is writable, as it was for its sender)."""
    import torch

    view = memoryview(buffer)
    if view.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(bytearray(view) if view.readonly else buffer, dtype=torch.uint8)
    tensor = flat.view(getattr(torch, dtype)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def loads(frames: Sequence[Any]) -> Any:
    """Rebuild an object from ``dumps`` frames (bytes, memoryviews or zmq Frames)."""
    if len(frames) == 1 and type(frames[0]) is bytes:  # most small values: no buffers
        return pickle.loads(frames[0])
    main, *buffers = (_as_buffer(frame) for frame in frames)
    return pickle.loads(main, buffers=buffers)


def _as_buffer(frame: Any) -> Any:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame: a memoryview without a copy
    return buffer if buffer is not None else frame


def function_digest(pickled_function: Any) -> str:
    """A short content id of a pickled function (any bytes-like frame), so it is held,
    journaled and unpickled once per distinct function."""
    buffer = getattr(pickled_function, "buffer", pickled_function)  # a zmq.Frame's bytes
    return hashlib.blake2b(buffer, digest_size=12).hexdigest()


def split_frames(frames: Sequence[Any], limit: int) -> tuple[list[Any], list[int] | None]:
    """Frames no larger than ``limit``, for a peer whose sockets refuse bigger ones, and the
    layout (wire frames per original frame) to rebuild them; None when nothing was split.

    Big frames become memoryview slices of the original: nothing is copied to send them."""
    for frame in frames:  # a loop: this runs for every task a client sends
        if frame_nbytes(frame) > limit:
            break
    else:
        return list(frames), None
    wire: list[Any] = []
    layout: list[int] = []
    for frame in frames:
        size = frame_nbytes(frame)
        if size <= limit:
            wire.append(frame)
            layout.append(1)
            continue
        view = memoryview(_as_buffer(frame)).cast("B")
        pieces = [view[start:start + limit] for start in range(0, size, limit)]
        wire.extend(pieces)
        layout.append(len(pieces))
    return wire, layout


def wire_cost(frames: Sequence[Any], limit: int,
              shared: Sequence[tuple[int, str, int]] = ()) -> tuple[int, int]:
    """The payload bytes and frames ``frames`` take in a message once ``split_frames`` cut
    them to ``limit``; ``shared`` references (index, name, size) count their frame at its size
    (the frame read back in from shared memory for a peer that does not map it)."""
    nbytes = count = 0
    for frame in frames:  # a loop: this runs for every task a client sends
        size = frame_nbytes(frame)
        nbytes += size
        count += 1 if size <= limit else -(-size // limit)
    for index, _, size in shared:
        if 0 <= index < len(frames):
            placeholder = frame_nbytes(frames[index])
            nbytes += size - placeholder
            count += _slices(size, limit) - _slices(placeholder, limit)
    return nbytes, count


def _slices(size: int, limit: int) -> int:
    return 1 if size <= limit else -(-size // limit)


def join_frames(frames: Sequence[Any], layout: Sequence[int] | None) -> list[Any]:
    """Undo ``split_frames``: one copy for each frame that was split, none for the rest.

    Raises ValueError when the layout does not match the frames."""
    if not layout:
        return list(frames)
    if sum(layout) != len(frames) or any(count < 1 for count in layout):
        raise ValueError(f"a split layout of {sum(layout)} frames for {len(frames)} frames")
    out: list[Any] = []
    index = 0
    for count in layout:
        if count == 1:
            out.append(frames[index])
        else:  # a bytearray: what is rebuilt from it (a numpy array) stays writable
            out.append(bytearray().join(_as_buffer(frame) for frame in frames[index:index + count]))
        index += count
    return out


def writable(frames: Sequence[Any]) -> list[Any]:
    """``dumps`` frames whose out-of-band buffers are writable, so arrays rebuilt from them are
    too, as they were for the caller who sent them. Frames received from a socket are read-only:
    those are copied (at most one frame limit each; bigger ones were rebuilt by join_frames, or
    mapped copy-on-write or read from shared memory)."""
    out = list(frames)
    for index in range(1, len(out)):
        view = memoryview(_as_buffer(out[index]))
        if view.readonly:
            out[index] = bytearray(view)
    return out


def frame_nbytes(frame: Any) -> int:
    """The size of a frame: bytes, a buffer, or a zmq.Frame."""
    if type(frame) is bytes:  # most frames: a small pickle or header
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    buffer = getattr(frame, "buffer", None)  # a zmq.Frame
    return buffer.nbytes if buffer is not None else len(frame)


def payload_nbytes(frames: Sequence[Any]) -> int:
    total = 0
    for frame in frames:  # a loop, not sum() over a generator: called several times a task
        total += frame_nbytes(frame)
    return total
