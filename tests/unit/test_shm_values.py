"""A server's value segments (kvps/wire/shm.py: Values) and a worker's read-only maps of them
(Reader), in one process: a key gets at most two blocks, located by address; a worker maps only
kvps memfds holding their nonce, in order, read-only, and says so in its claim."""
import os

import numpy as np
import pytest

from kvps.wire.shm import MIN_BYTES, Reader, Segment, ShmRefused, Values


def test_a_key_gets_two_blocks_in_segments_then_private_memory():
    values = Values(segment_bytes=1 << 20)
    a = values.alloc(("w", 0), np.float32, (256, 256))           # 256 KB
    b = values.alloc(("w", 0), np.float32, (256, 256))
    assert a.shape == b.shape == (256, 256) and a.dtype == np.float32
    assert values.alloc(("w", 0), np.float32, (256, 256)) is None  # its value and round buffer only
    assert values.alloc(("tiny", 0), np.float32, (MIN_BYTES // 8,)) is None
    (sa, oa), (sb, ob) = values.locate(a), values.locate(b)
    assert sa == sb == 0 and oa >= 64 and oa % 64 == 0 and ob >= oa + a.nbytes
    big = values.alloc(("big", 0), np.float64, (300_000,))        # more than a segment: one of its own
    assert values.locate(big)[0] == 1 and values.count == 2
    assert values.locate(np.empty(MIN_BYTES, np.uint8)) is None    # private memory
    assert values.locate(a[:, ::2]) is None                        # not contiguous
    assert values.locate(a[1:]) == (0, oa + a[0].nbytes)
    values.close()


def test_a_worker_reads_the_servers_values_read_only():
    values = Values(segment_bytes=1 << 20)
    a = values.alloc(("w", 0), np.float32, (1 << 16,))
    a[:] = np.arange(a.size)
    reader = Reader("S0", os.getpid())     # the "server" is this process: /proc/<pid>/fd works
    assert reader.claim() == 0
    reader.offered(values.offers(reader.claim()))
    assert reader.claim() == 1
    reader.offered(values.offers(0))       # offered again by a reply sent before the claim: no change
    assert reader.claim() == 1
    segment, offset = values.locate(a)
    view = reader.view(segment, offset, a.nbytes).view(np.float32)
    assert np.array_equal(view, a)
    a[7] = -1.0
    assert view[7] == -1.0                 # the same memory
    with pytest.raises(ValueError):
        view[0] = 5.0                      # read-only for the worker
    for place in ((segment, offset, 1 << 30), (segment, 0, 8), (5, 64, 8)):   # past the end, nonce, unmapped
        with pytest.raises(ShmRefused):
            reader.view(*place)
    values.close()


def test_offers_out_of_order_or_without_the_nonce_turn_reading_off():
    mine = Segment(0, 4096)
    reader = Reader("S0", os.getpid())
    reader.offered([[1, mine.fd, mine.nonce]])
    assert reader.claim() is None and "segment 1 before segment 0" in reader.refused
    reader = Reader("S0", os.getpid())
    reader.offered([[0, mine.fd, b"\0" * 16]])
    assert reader.claim() is None and "nonce" in reader.refused
    with open(os.devnull) as other:
        reader = Reader("S0", os.getpid())
        reader.offered([[0, other.fileno(), mine.nonce]])
    assert reader.claim() is None and "not a kvps memfd" in reader.refused
    mine.close()
