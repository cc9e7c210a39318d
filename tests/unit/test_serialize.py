"""Unit tests for gpumesh.protocol.serialize: pickle protocol 5 with out-of-band buffers."""

from __future__ import annotations

import io
import pickle

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumesh.protocol.serialize import (
    OUT_OF_BAND_THRESHOLD,
    dumps,
    function_digest,
    loads,
    payload_nbytes,
)


class Point:
    """A class defined at module level in the test file."""

    def __init__(self, x: int, y: int) -> None:
        self.x = x
        self.y = y

    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def _round_trip(obj):
    frames = dumps(obj)
    assert isinstance(frames, list) and frames
    assert isinstance(frames[0], bytes)
    return frames, loads(frames)


def test_dict_round_trip_stays_in_one_frame() -> None:
    value = {"a": 1, "b": [1.5, "two", None, True], "c": {"nested": (1, 2)}, 3: b"bytes"}
    frames, back = _round_trip(value)
    assert len(frames) == 1
    assert back == value
    assert back is not value
    assert isinstance(back["c"]["nested"], tuple)


def test_lambda_round_trip() -> None:
    offset = 10
    fn = lambda x, y=2: x * y + offset  # noqa: E731
    frames, back = _round_trip(fn)
    assert len(frames) == 1
    assert back(3) == 16
    assert back(3, y=5) == 25


def test_nested_function_with_closure_round_trip() -> None:
    def make_counter(start: int):
        def step(n: int) -> list[int]:
            return [start + i for i in range(n)]

        return step

    _, back = _round_trip(make_counter(5))
    assert back(3) == [5, 6, 7]


def test_module_level_class_round_trip() -> None:
    _, back = _round_trip(Point(3, -4))
    assert back == Point(3, -4)
    assert back.norm1() == 7


def test_class_defined_inside_the_test_round_trip() -> None:
    class Local:
        factor = 3

        def __init__(self, v: int) -> None:
            self.v = v

        def scaled(self) -> int:
            return self.v * self.factor

    # A local class cannot be pickled by reference: stdlib pickle refuses it.
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(Local(1))

    frames, back = _round_trip(Local(7))
    assert len(frames) == 1
    assert back.v == 7
    assert back.scaled() == 21
    assert type(back).__name__ == "Local"

    # The class itself travels too.
    _, cls = _round_trip(Local)
    assert cls(2).scaled() == 6


def test_exception_instance_round_trip() -> None:
    _, back = _round_trip(ValueError("boom", 3))
    assert isinstance(back, ValueError)
    assert back.args == ("boom", 3)


def test_large_numpy_array_goes_out_of_band() -> None:
    array = numpy.arange(200_000, dtype=numpy.float64)  # 1.6 MB
    frames = dumps(array)
    assert len(frames) > 1
    assert len(frames) == 2
    assert isinstance(frames[1], memoryview)
    assert frames[1].nbytes == array.nbytes
    # The main pickle does not carry the data.
    assert len(frames[0]) < 1024
    assert payload_nbytes(frames) == len(frames[0]) + array.nbytes

    back = loads(frames)
    assert isinstance(back, numpy.ndarray)
    assert back.dtype == array.dtype
    assert back.shape == array.shape
    numpy.testing.assert_array_equal(back, array)


def test_out_of_band_frames_survive_a_copy_to_bytes() -> None:
    # What arrives over a socket is bytes, not the sender's memoryviews.
    array = numpy.arange(100_000, dtype=numpy.int32).reshape(250, 400)
    frames = dumps(array)
    assert len(frames) == 2
    received = [bytes(f) for f in frames]
    back = loads(received)
    assert back.shape == (250, 400)
    numpy.testing.assert_array_equal(back, array)


def test_loads_accepts_memoryview_frames() -> None:
    array = numpy.linspace(0.0, 1.0, 50_000)
    frames = dumps({"weights": array, "name": "w"})
    assert len(frames) == 2
    views = [memoryview(bytes(f)) for f in frames]
    back = loads(views)
    assert back["name"] == "w"
    numpy.testing.assert_array_equal(back["weights"], array)


def test_loads_accepts_memoryview_main_frame_for_in_band_object() -> None:
    frames = dumps([1, 2, 3])
    assert loads([memoryview(frames[0])]) == [1, 2, 3]


def test_loads_uses_a_frame_buffer_attribute() -> None:
    class FakeZmqFrame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    array = numpy.arange(20_000, dtype=numpy.float64)
    frames = dumps(array)
    back = loads([FakeZmqFrame(bytes(f)) for f in frames])
    numpy.testing.assert_array_equal(back, array)


def test_small_numpy_array_stays_in_band() -> None:
    array = numpy.arange(100, dtype=numpy.float64)
    frames, back = _round_trip(array)
    assert len(frames) == 1
    numpy.testing.assert_array_equal(back, array)
    assert back.dtype == numpy.float64


def test_threshold_boundary() -> None:
    below = numpy.zeros(OUT_OF_BAND_THRESHOLD - 1, dtype=numpy.uint8)
    at = numpy.zeros(OUT_OF_BAND_THRESHOLD, dtype=numpy.uint8)
    assert len(dumps(below)) == 1
    assert len(dumps(at)) == 2
    numpy.testing.assert_array_equal(loads(dumps(at)), at)


def test_several_arrays_give_one_frame_each_in_order() -> None:
    a = numpy.full(20_000, 1.0)
    b = numpy.full(30_000, 2, dtype=numpy.int64)
    small = numpy.arange(5)
    frames = dumps((a, small, b))
    assert len(frames) == 3
    assert [f.nbytes for f in frames[1:]] == [a.nbytes, b.nbytes]
    ra, rsmall, rb = loads(frames)
    numpy.testing.assert_array_equal(ra, a)
    numpy.testing.assert_array_equal(rsmall, small)
    numpy.testing.assert_array_equal(rb, b)


def test_fortran_and_non_contiguous_arrays_round_trip() -> None:
    base = numpy.arange(300 * 400, dtype=numpy.float64).reshape(300, 400)
    fortran = numpy.asfortranarray(base)
    strided = base[::2, ::3]
    assert not strided.flags.c_contiguous and not strided.flags.f_contiguous
    back_f, back_s = loads(dumps((fortran, strided)))
    numpy.testing.assert_array_equal(back_f, base)
    numpy.testing.assert_array_equal(back_s, strided)


def test_structured_array_round_trip() -> None:
    dtype = numpy.dtype([("id", numpy.int32), ("score", numpy.float32)])
    array = numpy.zeros(20_000, dtype=dtype)
    array["id"] = numpy.arange(20_000)
    array["score"] = 0.5
    frames = dumps(array)
    assert len(frames) == 2
    back = loads(frames)
    assert back.dtype == dtype
    numpy.testing.assert_array_equal(back, array)


def test_function_digest_is_stable_and_content_addressed() -> None:
    pickled = dumps(lambda x: x + 1)[0]
    digest = function_digest(pickled)
    assert digest == function_digest(bytes(pickled))
    assert len(digest) == 24
    int(digest, 16)  # hex
    assert function_digest(pickled + b"\x00") != digest
    assert function_digest(b"") == function_digest(b"")


def test_payload_nbytes_counts_bytes_of_views() -> None:
    view = memoryview(numpy.zeros(10, dtype=numpy.float64))
    assert len(view) == 10
    assert payload_nbytes([b"abc", view, bytearray(2)]) == 3 + 80 + 2
    assert payload_nbytes([]) == 0


# ----------------------------------------------------------------- torch tensors
# torch pickles a tensor's storage in-band through torch.save (0.4 s for 64 MiB here); a plain
# CPU tensor goes as its bytes in one buffer instead, and comes back equal in every respect.


def _torch():
    from conftest import require

    return require("torch")


def test_a_big_tensor_is_one_out_of_band_buffer_over_its_own_memory() -> None:
    torch = _torch()
    tensor = torch.arange(100_000, dtype=torch.float32)
    frames = dumps(tensor)
    assert len(frames) == 2 and frames[1].nbytes == 400_000 and len(frames[0]) < 300
    assert frames[1].obj is not None  # a view, not a copy: writing the tensor shows in it
    tensor[0] = 42.0
    assert memoryview(frames[1]).cast("f")[0] == 42.0
    back = loads(frames)
    assert torch.equal(back, tensor) and back.dtype == torch.float32 and back.shape == (100_000,)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "int8", "int64",
                                   "bool", "complex64", "uint8"])
def test_every_dense_dtype_and_shape_comes_back_equal(dtype) -> None:
    torch = _torch()
    base = torch.arange(2 * 3 * 5000, dtype=torch.float64).reshape(2, 3, 5000)
    tensor = (base % 2 == 0) if dtype == "bool" else base.to(getattr(torch, dtype))
    back = loads(dumps(tensor))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    assert back.is_contiguous() and back.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_gradients_parameters_and_small_tensors_keep_what_they_were() -> None:
    torch = _torch()
    weight = torch.nn.Parameter(torch.randn(300, 300))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    leaf = torch.randn(10, requires_grad=True)
    back = loads(dumps({"w": weight, "frozen": frozen, "leaf": leaf, "empty": torch.empty(0)}))
    assert type(back["w"]) is torch.nn.Parameter and back["w"].requires_grad
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad
    assert back["leaf"].requires_grad and torch.equal(back["leaf"].detach(), leaf.detach())
    assert torch.equal(back["w"].detach(), weight.detach()) and back["empty"].numel() == 0


def test_views_and_odd_tensors_pickle_as_torch_pickles_them() -> None:
    torch = _torch()
    whole = torch.arange(40_000, dtype=torch.float32)
    part = whole[100:30_100]  # a view into a bigger storage: torch sends the storage, offset
    transposed = whole.reshape(200, 200).t()  # not contiguous: torch keeps the strides
    frames = dumps([whole, part, transposed])
    assert len(frames) == 2  # the whole one's bytes only; torch's own way writes the others
    back = loads(frames)
    assert torch.equal(back[0], whole)
    assert torch.equal(back[1], part) and back[1].storage_offset() == 100
    assert torch.equal(back[2], transposed) and back[2].stride() == transposed.stride()


def test_a_tensor_from_a_read_only_buffer_is_a_writable_copy() -> None:
    torch = _torch()
    tensor = torch.ones(50_000)
    main, buffer = dumps(tensor)
    back = loads([main, bytes(buffer)])  # bytes: read-only, as a socket's frame is
    back[0] = 2.0  # would fault on read-only memory
    assert back[0] == 2.0 and tensor[0] == 1.0


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.complex_numbers(allow_nan=False), st.text(max_size=20),
                     st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=8), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=6)),
    max_leaves=80)


@settings(max_examples=300, database=None, deadline=None)
@given(_values)
def test_plain_data_pickles_to_the_bytes_cloudpickle_writes(value):
    # Small plain values (a tiny task's arguments and result) skip cloudpickle's set-up: what
    # goes on the wire must not change for them, and whatever is not plain goes as before.
    from gpumesh.protocol import serialize

    with io.BytesIO() as out:
        serialize._Pickler(out, protocol=serialize.PROTOCOL).dump(value)
        by_cloudpickle = out.getvalue()
    assert serialize.dumps(value) == [by_cloudpickle]
    assert serialize.loads(serialize.dumps(value)) == value


def test_what_is_not_plain_data_still_goes_through_cloudpickle():
    from gpumesh.protocol import serialize

    assert serialize._plain(((1, "a"), {"k": [b"x", None, 2.5]}))
    cyclic: list = []
    cyclic.append(cyclic)
    for value in (lambda: 1, bytearray(b"x"), [object()], list(range(100)), cyclic,
                  {i: i for i in range(40)}, ((numpy.zeros(3),), {})):
        assert not serialize._plain(value), value
    assert serialize.loads(serialize.dumps(cyclic))[0][0] is not None  # still round-trips


# ----------------------------------------------------------------- big bytes


class Holder:
    """An object of another kind that holds a value: the scan does not look inside it."""

    def __init__(self, x) -> None:
        self.x = x


def test_big_bytes_go_out_of_band_over_their_own_memory() -> None:
    # pickle writes bytes in-band: 64 MiB cost 27-40 ms to pickle on the test machine. Out of
    # band the argument is sent from its own memory, and rebuilt as bytes.
    data = bytes(range(256)) * (OUT_OF_BAND_THRESHOLD // 256 * 4)
    frames = dumps(((data, 7, list(range(200))), {"flag": True}))
    assert len(frames) == 2
    assert len(frames[0]) < 2048  # the main pickle does not carry the data
    assert isinstance(frames[1], memoryview) and frames[1].obj is data
    (back, seven, numbers), kwargs = loads(frames)
    assert type(back) is bytes and back == data and seven == 7 and kwargs == {"flag": True}
    assert numbers == list(range(200))
    result = dumps(data)  # a task that returns bytes
    assert len(result) == 2 and result[1].obj is data
    assert loads([bytes(f) for f in result]) == data
    # Four levels inside an argument, beside arrays of numbers and bytearrays.
    frames = dumps((([[data]], numpy.zeros(3), bytearray(b"x")), {}))
    assert len(frames) == 2 and frames[1].obj is data
    (nested, zeros, small), _ = loads(frames)
    assert nested == [[data]] and not zeros.any() and small == bytearray(b"x")


def test_what_is_shared_in_an_argument_stays_one_object() -> None:
    data = bytes(OUT_OF_BAND_THRESHOLD)
    inner = [data, 1]
    frames = dumps(((data, inner, inner), {"again": data}))
    assert len(frames) == 2  # one buffer for the one object
    (first, a, b), kwargs = loads(frames)
    assert first is a[0] is kwargs["again"] and a is b and first == data
    # A key and a value: one object, sent once.
    frames = dumps({data: data})
    assert len(frames) == 2
    ((key, value),) = loads(frames).items()
    assert key is value and key == data


def test_bytes_reached_through_another_object_stay_in_band_and_shared() -> None:
    # A copy of the list the Holder holds would come back as a second list beside the
    # original, and the bytes would be sent twice.
    data = bytes(OUT_OF_BAND_THRESHOLD)
    shared = [data, 1]
    frames = dumps((shared, Holder(shared)))
    assert len(frames) == 1
    a, b = loads(frames)
    assert a is b.x and a[0] == data
    frames = dumps((data, numpy.array([shared], dtype=object)))  # an array of objects
    assert len(frames) == 1


def test_a_bytearray_goes_as_it_was_at_the_call_and_stays_the_callers() -> None:
    # In-band, as pickle writes it: a copy made when the task is submitted. A buffer over it
    # would send what it holds later, and keep the caller from resizing it meanwhile.
    data = bytearray(b"q" * (2 * OUT_OF_BAND_THRESHOLD))
    frames = dumps((data,))
    data[0] = ord("r")
    data.clear()  # no buffer of it is held
    (back,) = loads(frames)
    assert type(back) is bytearray and len(back) == 2 * OUT_OF_BAND_THRESHOLD
    assert back[0] == ord("q")


def test_bytes_under_the_threshold_or_past_the_scan_stay_in_band() -> None:
    from gpumesh.protocol import serialize

    small = bytes(OUT_OF_BAND_THRESHOLD - 1)
    assert len(dumps(((small,), {}))) == 1
    assert len(dumps(((bytes(OUT_OF_BAND_THRESHOLD),), {}))) == 2  # the boundary goes out
    big = bytes(OUT_OF_BAND_THRESHOLD)
    # Among more values than a call may look through, or deeper: in-band, as before.
    many = [big] + [(i,) for i in range(serialize.BIG_BYTES_VISITS)]
    lots = [big, list(range(serialize.BIG_BYTES_VALUES))]
    deep: list = [big]
    for _ in range(serialize.BIG_BYTES_DEPTH):
        deep = [deep]
    for value in (many, lots, deep):
        frames = dumps(value)
        assert len(frames) == 1 and loads(frames) == value
    cyclic: list = [big]
    cyclic.append(cyclic)
    frames = dumps(cyclic)
    back = loads(frames)
    assert len(frames) == 1 and back[0] == big and back[1] is back
    point = Point(big, 1)  # type: ignore[arg-type]
    assert len(dumps(point)) == 1 and loads(dumps(point)) == point
