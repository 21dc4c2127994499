"""A request that names a worker's shared memory with one server, sent to another (KVPS_REPLICAS: the
new head of its range after a death, or a copy along the chain): its values go inline, in their
places among the other payloads, and what it said about the first server's memory goes. No sockets."""
import numpy as np
import pytest

from kvps.errors import ProtocolError
from kvps.kvstore.ps import _rehomed
from kvps.wire import lane, protocol
from kvps.wire.protocol import Entry, Header, Op, dtype_code
from kvps.wire.requests import Handle, Requests
from kvps.wire.shm import LINK_META, Arena, ShmRefused, inlined

F32 = dtype_code(np.float32)


def _arena():
    return Arena("S1", lambda segment, fd, nonce: None, segment_bytes=1 << 20, pid=4242)


def _push(arena):
    """A PUSHPULL of three parts: the first and last in shared memory, the middle one inline."""
    first, last = arena.region(("w", 0, "push"), 1 << 16), arena.region(("w", 2, "push"), 1 << 17)
    first.array(np.float32, 1 << 14)[:] = 1.5
    last.array(np.float32, 1 << 15)[:] = np.arange(1 << 15)
    middle = np.full(10, 7.0, np.float32)
    keys = [Entry("w", 0, F32, (1 << 14,), 0), Entry("w", 1, F32, (10,), 40), Entry("w", 2, F32, (1 << 15,), 0)]
    meta = {"home": 1, "shm": [[0, first.segment, first.offset], [2, last.segment, last.offset]],
            "into": [[1, first.segment, 64]], "mapped": 3, "done": [5, 6]}
    return Header(Op.PUSHPULL, 17, "W0", keys, meta), [memoryview(middle.view(np.uint8))]


def test_values_in_shared_memory_go_inline_in_their_places():
    arena = _arena()
    header, payloads = _push(arena)
    moved, frames = inlined(header, payloads, arena.view)
    assert (moved.op, moved.id, moved.src) == (Op.PUSHPULL, 17, "W0")
    assert moved.meta == {"home": 1}          # nothing about S1's memory is left
    assert [e.nbytes for e in moved.keys] == [1 << 16, 40, 1 << 17]
    # what a server decodes: the frames match the entries, values as the worker wrote them
    got, received = protocol.unpack([moved.encode(), *(bytes(f) for f in frames)])
    assert np.all(protocol.as_array(received[0], got.keys[0]) == 1.5)
    assert np.all(protocol.as_array(received[1], got.keys[1]) == 7.0)
    assert np.array_equal(protocol.as_array(received[2], got.keys[2]), np.arange(1 << 15, dtype=np.float32))
    assert header.meta["shm"] and header.keys[0].nbytes == 0   # the request itself is unchanged
    arena.close()


def test_a_request_without_shared_memory_is_left_as_it_is():
    header = Header(Op.PULL, 3, "W0", [Entry.bare("k", 0, F32, (4,))], {"home": 0})
    assert _rehomed({1: _arena()}, header, [], "S1") == (header, [])
    copy, frames = inlined(header, [], None, drop=("home",))
    assert copy.meta == {} and frames == [] and copy.keys == header.keys


def test_the_worker_reads_the_values_from_its_memory_with_the_dead_server():
    arena = _arena()
    header, payloads = _push(arena)
    moved, frames = _rehomed({1: arena, 0: None}, header, payloads, "S1")
    assert not set(LINK_META) & set(moved.meta) and len(frames) == 3
    assert np.all(np.frombuffer(frames[0], np.float32) == 1.5)
    with pytest.raises(ShmRefused, match="shares none with it"):     # memory with S0 it never had
        _rehomed({1: arena, 0: None}, header, payloads, "S0")
    arena.close()


def test_memory_outside_the_arena_is_refused():
    arena = _arena()
    region = arena.region(("w", 0, "push"), 1 << 16)
    with pytest.raises(ShmRefused, match="segment 3"):
        arena.view(3, 64, 16)
    with pytest.raises(ShmRefused, match="outside segment"):
        arena.view(region.segment, 32, 16)            # the nonce's bytes
    with pytest.raises(ShmRefused, match="outside segment"):
        arena.view(region.segment, region.offset, 2 << 20)
    arena.close()


def test_a_redirected_request_is_rehomed_once_and_kept_so():
    requests = Requests(keep_data=True)
    arena = _arena()
    requests.rehome = lambda header, payloads, dead: _rehomed({1: arena}, header, payloads, dead)
    header, payloads = _push(arena)
    handle = Handle("pushpull", 5)
    header.id = requests.add(handle, "S1", message=(header, payloads))
    handle._arm()
    [(peer, sent, frames)] = requests.redirect("S1", lambda h: "S2")
    assert peer == "S2" and sent.id == header.id and "shm" not in sent.meta and len(frames) == 3
    # S2 dies too: the kept message is the inline one, sent as it is
    [(peer, again, frames_again)] = requests.redirect("S2", lambda h: "S0")
    assert peer == "S0" and again is sent and frames_again is frames
    # a request still addressed to S1 after its death was known goes inline to its new head
    late, late_payloads = _push(arena)
    late.id = requests.add(Handle("push", 5), "S1", message=(late, late_payloads))
    assert requests.peer_of(late.id, "S1") == "S2"
    moved, _ = requests.rehomed(late.id, "S1", late, late_payloads)
    assert "shm" not in moved.meta
    [(_, kept, _)] = [r for r in requests.redirect("S2", lambda h: "S0") if r[1].id == late.id]
    assert kept is moved
    arena.close()


def test_a_lanes_kept_frames_are_rehomed():
    arena = _arena()
    requests = Requests()
    requests.rehome = lambda header, payloads, dead: _rehomed({1: arena}, header, payloads, dead)
    header, payloads = _push(arena)
    frames = [header.encode(), *(bytes(p) for p in payloads)]
    moved = lane._rehomed(requests, frames, "S1")
    got, received = protocol.unpack(moved)
    assert "shm" not in got.meta and len(received) == 3 and got.id == 17
    plain = [Header(Op.PULL, 1, "W0", [Entry.bare("k", 0, F32, (4,))], {"home": 1}).encode()]
    assert lane._rehomed(requests, plain, "S1") is plain
    arena.close()


def test_a_copy_along_the_chain_names_memory_the_worker_never_shared():
    from server.replication import Chain
    chain = Chain.__new__(Chain)
    chain.server = type("Server", (), {"shared": {}})()
    header, payloads = _push(_arena())
    view = chain._worker_memory(header)
    with pytest.raises(ProtocolError, match="never attached"):
        inlined(header, payloads, view)
