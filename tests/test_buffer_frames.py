"""Arrow batches as ZeroMQ buffer frames (buffer.frames): round trips, and hostile layouts."""

import pyarrow as pa
import pytest
import zmq

from buffer import wire
from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.demo import synthetic_samples
from buffer.frames import INLINE_MAX, batches_to_frames, frames_to_batches
from buffer.record import samples_to_batch
from buffer.server import BufferServer
from buffer.validate import check_batch


def _roundtrip(batches):
    layout, frames = batches_to_frames(batches)
    return frames_to_batches(layout, [bytes(f) for f in frames])


def test_slices_nulls_and_empty_batches_round_trip():
    b = samples_to_batch(synthetic_samples(40, 4, 300, 20))
    pieces = [b.slice(3, 50), b.slice(0, 0), b.slice(100, 60), b]
    assert all(p.equals(g) for p, g in zip(pieces, _roundtrip(pieces), strict=True))
    # a column with nulls at an odd offset (the server rejects nulls, but the frames carry them)
    cols = b.slice(0, 9).columns
    cols[b.schema.get_field_index("prompt")] = pa.array(["a", None, "c", "d"] * 3).slice(3)
    nb = pa.RecordBatch.from_arrays(cols, schema=b.schema)
    assert _roundtrip([nb])[0].equals(nb)


def test_large_buffers_travel_as_their_own_frames_without_copy():
    b = samples_to_batch(synthetic_samples(16, 4, 2048, 16))
    layout, frames = batches_to_frames([b])
    values = b.column("response_ids").values.buffers()[1]
    assert values.size >= INLINE_MAX
    spans = [(pa.py_buffer(f).address, pa.py_buffer(f).size) for f in frames[1:]]
    assert any(a <= values.address and values.address + values.size <= a + n for a, n in spans)  # no copy


def test_token_columns_of_one_conversion_travel_as_one_frame():
    b = samples_to_batch(synthetic_samples(40, 4, 2048, 256))
    layout, frames = batches_to_frames([b])
    assert len(frames) == 2  # frame 0 + the five token columns, which lie in one block
    big = pa.py_buffer(frames[1])
    cols = [b.column(n).values.buffers()[1] for n in ("prompt_ids", "response_ids", "loss_mask")]
    assert big.address == cols[0].address and big.address + big.size == cols[-1].address + cols[-1].size
    raw = big.to_pybytes()
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "versions"):
        v = b.column(name).values.buffers()[1]
        end = v.address - big.address + v.size
        assert raw[end : end + (-end % 64)] == bytes(-end % 64)  # the gaps are zeros, not stale memory
    (got,) = frames_to_batches(layout, [bytes(f) for f in frames])
    assert got.equals(b)
    # the one-frame-per-buffer form (another sender, or slices) is read the same way
    split = [
        b.column(n).values.buffers()[1]
        for n in ("prompt_ids", "response_ids", "rollout_logprobs", "versions", "loss_mask")
    ]
    (got,) = frames_to_batches(layout, [bytes(frames[0]), *[x.to_pybytes() for x in split]])
    assert got.equals(b)
    for bad in (
        [big.to_pybytes() + b"\0" * 64],
        [big.to_pybytes()[:-1]],
        [big.to_pybytes()[:-64], b"x" * 64],
    ):
        with pytest.raises(wire.ProtocolError, match="do not match their layout"):
            frames_to_batches(layout, [bytes(frames[0]), *bad])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda lay, fr: ([lay[0][:-1]], fr),  # too few sizes
        lambda lay, fr: ([[lay[0][0] + 5, *lay[0][1:]]], fr),  # more rows than the buffers hold
        lambda lay, fr: (lay, fr[:-1]),  # a frame missing
        lambda lay, fr: (lay, [*fr, b"x" * INLINE_MAX]),  # an extra frame
        lambda lay, fr: (lay, [fr[0][:-8], *fr[1:]]),  # frame 0 short
        lambda lay, fr: ([[lay[0][0], -7, *lay[0][2:]]], fr),  # a negative size
    ],
)
def test_bad_layouts_are_protocol_errors(mutate):
    b = samples_to_batch(synthetic_samples(8, 4, 4096, 16))
    layout, frames = batches_to_frames([b])
    lay, fr = mutate(layout, [bytes(f) for f in frames])
    with pytest.raises(wire.ProtocolError) as e:
        for got in frames_to_batches(lay, fr):
            check_batch(got)
    assert e.value.category in ("invalid_arrow", "invalid_sample")


def test_server_rejects_a_bad_layout_and_keeps_serving(tmp_path):
    srv = BufferServer(BufferConfig(durable=False)).start()
    try:
        b = samples_to_batch(synthetic_samples(2))
        layout, frames = batches_to_frames([b])
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(srv.address)
        head = wire.IngestBatch(producer="p", seq=1, num_samples=8, layout=[layout[0][:-1]])
        s.send_multipart([wire.encode(head), *frames])
        reply = wire.decode(s.recv_multipart()[0])
        assert isinstance(reply, wire.Error) and "layout" in reply.reason
        s.close(0)
        c = BufferClient(srv.address, timeout_s=10, window_mb=0.001)  # a byte window below one message
        assert c.put(b, timeout_s=10).accepted == 8
        assert c.stats()["rejects"] == {"invalid_arrow": 1}
        table = c.fetch_table(2, 0, 0, timeout_s=2)
        assert isinstance(table, pa.Table) and table.num_rows == 8
        c.close()
    finally:
        srv.stop()
