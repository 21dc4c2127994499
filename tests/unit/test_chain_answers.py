"""A head's side of one replica in a sync job (server/replication.py: Chain), without sockets: a
worker's reply waits until the replica has answered the ROUND of every sum made so far (deferred
copies get no answer of their own); the sums the replica reads in our memory stay ours to keep until
it says it released them; sums it cannot read there go again inline; a ROUND it refuses turns the
waiting replies into errors."""
import types

import numpy as np
import pytest

from kvps.wire.protocol import Entry, Header, Op
from server.replication import Chain

pytestmark = pytest.mark.unit


class Van:
    def __init__(self):
        self.sent, self.replies, self.calls = [], [], []

    def call_soon(self, fn):
        self.calls.append(fn)

    def turn_ends(self):
        """What the I/O thread runs once it has handled what it read (Van._flush)."""
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()

    def connect(self, peer, host, port):
        pass

    def send(self, peer, header, payloads=(), on_sent=None, bundle=False):
        self.sent.append((peer, header))
        if on_sent is not None:
            on_sent()

    def reply(self, routing_id, header, payloads=(), on_tracker=None, bundle=False):
        self.replies.append((routing_id, header))


class Values:
    """The head's value segments: every sum lies in segment 0."""
    count = 1

    @staticmethod
    def locate(array):
        return 0, 64

    @staticmethod
    def offers(start):
        return []


def _head(shared=False):
    server = types.SimpleNamespace(
        cfg=types.SimpleNamespace(replicas=1), rank=0, name="S0", host="127.0.0.1",
        membership={"servers": [["127.0.0.1", 1, 10], ["127.0.0.1", 2, 11]]},
        van=Van(), homes={}, values=Values() if shared else None, answered=[],
        store=types.SimpleNamespace(forwarding=lambda slot, tracker: trackers.append(tracker)))
    server.send_answer = lambda routing_id, request, reply, payloads=(), on_tracker=None: \
        server.answered.append((request.id, reply))
    trackers = []
    chain = Chain(server)
    chain.defer = True
    return chain, server, trackers


def _push(chain, request_id, closes=True, key="w", turn_ends=True):
    """W0's PUSH of `key` handled at the head; `closes`: its round closes (the sum is made and
    the reply is ready); `turn_ends`: the I/O turn ends after it. Returns whether the reply is held."""
    header = Header(Op.PUSH, request_id, "W0", [Entry.bare(key, 0, 0, (4,))], {"home": 0})
    fwd = chain.begin(header, [])
    held = []

    def handler():
        if closes:
            slot = types.SimpleNamespace(id=(key, 0), version=request_id)
            chain.round(slot, np.ones(4, np.float32))
            held.append(chain.hold(b"W0", header, Header(Op.ACK, request_id, "S0"), []))
    chain.handle(fwd, handler)
    if turn_ends:
        chain.server.van.turn_ends()
    return held[0] if held else None


def _rounds(server):
    return [h for peer, h in server.van.sent if h.op == Op.ROUND]


def test_a_reply_waits_for_the_answer_to_the_round_that_holds_its_push():
    chain, server, _ = _head()
    assert _push(chain, 1) is True
    copy, [round_] = server.van.sent[0][1], _rounds(server)
    assert copy.meta["deferred"] and copy.meta["chain"] and round_.meta["rounds"] == [1]
    assert server.answered == []
    chain.acked("S1", Header(Op.ACK, round_.id, "S1", meta={"for": "S0"}))
    assert [(i, h.op) for i, h in server.answered] == [(1, Op.ACK)]
    # applied already: the next reply is not held at all
    assert chain.hold(b"W0", Header(Op.PUSH, 9, "W0"), Header(Op.ACK, 9, "S0"), []) is False


def test_the_sums_of_one_turn_go_in_one_round_after_its_copies():
    chain, server, _ = _head()
    assert [_push(chain, i, key=f"k{i}", turn_ends=False) for i in (1, 2, 3)] == [True, True, True]
    assert _rounds(server) == []                    # not before the turn ends
    server.van.turn_ends()
    [round_] = _rounds(server)
    assert [h.op for _, h in server.van.sent] == [Op.PUSH, Op.PUSH, Op.PUSH, Op.ROUND]
    assert [e.key for e in round_.keys] == ["k1", "k2", "k3"] and round_.meta["rounds"] == [1, 2, 3]
    chain.acked("S1", Header(Op.ACK, round_.id, "S1", meta={"for": "S0"}))
    assert [i for i, _ in server.answered] == [1, 2, 3]


def test_a_sum_for_a_replica_that_died_in_the_turn_is_not_sent():
    chain, server, trackers = _head()
    _push(chain, 1, turn_ends=False)
    chain.dead = {1}                               # as changed() leaves it: S1 died, no successor
    chain._successors = {}
    server.van.turn_ends()
    assert _rounds(server) == [] and trackers[0].done


def test_sums_in_our_memory_stay_held_until_the_replica_releases_them():
    chain, server, trackers = _head(shared=True)
    _push(chain, 1)
    [first] = _rounds(server)
    assert first.meta["at"] == [[0, 0, 64]]
    chain.acked("S1", Header(Op.ACK, first.id, "S1", meta={"for": "S0"}))
    assert server.answered and not trackers[0].done          # applied, but still its value there
    _push(chain, 2)
    second = _rounds(server)[1]
    chain.acked("S1", Header(Op.ACK, second.id, "S1", meta={"for": "S0", "released": [first.id]}))
    assert trackers[0].done and not trackers[1].done


def test_sums_it_cannot_read_in_our_memory_go_again_inline_and_replies_wait_for_them():
    chain, server, trackers = _head(shared=True)
    _push(chain, 1)
    [first] = _rounds(server)
    chain.acked("S1", Header(Op.ACK, first.id, "S1", meta={"for": "S0", "inline": True}))
    again = _rounds(server)[1]
    assert "at" not in again.meta and again.keys[0].nbytes == 16 and trackers[0].done
    assert server.answered == []                               # not applied yet
    chain.acked("S1", Header(Op.ACK, again.id, "S1", meta={"for": "S0"}))
    assert [i for i, _ in server.answered] == [1]
    _push(chain, 2)
    assert "at" not in _rounds(server)[2].meta                 # and every later one inline


def test_a_refused_round_turns_the_waiting_replies_into_errors():
    chain, server, _ = _head()
    _push(chain, 1)
    [round_] = _rounds(server)
    chain.acked("S1", Header(Op.ERROR, round_.id, "S1",
                             meta={"for": "S0", "kind": "protocol", "message": "no round waits"}))
    [(request_id, reply)] = server.answered
    assert request_id == 1 and reply.op == Op.ERROR and "replica S1: no round waits" in reply.meta["message"]
