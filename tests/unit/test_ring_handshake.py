"""The ring's shared-memory handshake in one process (kvps/collective/shared.py): a segment is
mapped only from the registered left neighbour and only if it is a kvps memfd holding its nonce; a
place outside a mapped segment, and control messages from the wrong neighbour, are refused."""
import os

import numpy as np
import pytest

from kvps.collective.shared import Shared
from kvps.errors import ProtocolError
from kvps.wire.shm import Segment


class FakeNode:
    name = "W1"

    def __init__(self):
        pid = os.getpid()                 # every "worker" is this process: /proc/<pid>/fd works
        self.membership = {"workers": [["127.0.0.1", 1, pid], ["127.0.0.1", 2, pid], ["127.0.0.1", 3, pid]]}
        self.sent = []

    def send_to_peer(self, name, header, payloads=()):
        self.sent.append((name, header.meta))


def test_the_left_neighbours_segment_is_mapped_and_read_in_place():
    node = FakeNode()
    shared = Shared(node, 1, 3)           # left W0, right W2
    theirs = Segment(0, 4096)
    theirs.map[64:72] = b"abcdefgh"
    assert shared.control("W0", {"phase": "attach", "segment": 0, "fd": theirs.fd, "nonce": theirs.nonce})
    shared.map_waiting()
    assert node.sent == [("W0", {"phase": "attached", "segment": 0})]
    assert bytes(shared.view([0, 64], 8)) == b"abcdefgh"
    for at in ([0, 4090], [0, 0], [1, 64], "x", [0]):        # past the end, over the nonce, unmapped, junk
        with pytest.raises(ProtocolError, match="W0 placed a chunk"):
            shared.view(at, 8)


def test_a_segment_that_is_not_a_kvps_memfd_or_lacks_its_nonce_is_refused():
    node = FakeNode()
    shared = Shared(node, 1, 3)
    seg = Segment(0, 4096)
    with open(os.devnull) as other:
        shared.control("W0", {"phase": "attach", "segment": 0, "fd": other.fileno(), "nonce": seg.nonce})
        shared.control("W0", {"phase": "attach", "segment": 1, "fd": seg.fd, "nonce": b"\0" * 16})
        shared.map_waiting()
    answers = [meta for _, meta in node.sent]
    assert "not a kvps memfd" in answers[0]["refused"] and "nonce" in answers[1]["refused"], answers
    with pytest.raises(ProtocolError):
        shared.view([0, 64], 8)


def test_control_messages_only_from_the_neighbour_they_belong_to():
    node = FakeNode()
    shared = Shared(node, 1, 3)
    seg = Segment(0, 4096)
    attach = {"phase": "attach", "segment": 0, "fd": seg.fd, "nonce": seg.nonce}
    assert not shared.control("W2", attach)                          # only the left asks us to map
    assert not shared.control("W0", dict(attach, fd="3"))
    assert not shared.control("W0", {"phase": "attached", "segment": 0})   # only the right answers
    assert not shared.control("W2", {"phase": "attached", "segment": 0})   # ...for a segment we offered


def test_a_buffer_is_offered_once_and_goes_by_place_once_the_right_neighbour_mapped_it():
    node = FakeNode()
    shared = Shared(node, 1, 3)
    buf = shared.buffer(1000, np.float32)
    assert shared.place(buf) is None and shared.place(buf[10:]) is None
    assert [(to, meta["phase"]) for to, meta in node.sent] == [("W2", "attach")]     # asked once
    assert shared.control("W2", {"phase": "attached", "segment": node.sent[0][1]["segment"]})
    segment, offset = shared.place(buf[10:])
    assert offset == 64 + 40 and shared.placed == 1
    assert shared.place(np.empty(10, np.float32)) is None          # private memory: over TCP
    refused = shared.buffer(10, np.float32)
    shared.place(refused)
    assert shared.control("W2", {"phase": "attached", "segment": node.sent[-1][1]["segment"], "refused": "no"})
    assert shared.place(refused) is None


def test_close_lets_go_of_the_segments_and_later_buffers_are_never_placed():
    node = FakeNode()
    shared = Shared(node, 1, 3)
    buf = shared.buffer(1000, np.float32)
    fd = shared._mine[0][0].fd
    buf[:] = 7.0
    shared.close()
    with pytest.raises(OSError):
        os.fstat(fd)                      # the descriptor is closed
    assert float(buf.sum()) == 7000.0     # an array still in use keeps its memory
    assert shared.place(buf) is None
    shared.close()                        # twice is harmless
