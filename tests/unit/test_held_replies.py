"""A PUSHPULL's values sent before its push is applied at the replica (server/replication.py): the
worker copies them when they come, and the call ends with the acknowledgement that follows; asked
again of a new head meanwhile, it takes that head's answer."""
import numpy as np
import pytest

from kvps.wire.protocol import Entry, Header, Op
from kvps.wire.requests import Handle, Requests

pytestmark = pytest.mark.unit


def _pushpull(requests, copied):
    handle = Handle("pushpull of key 'w'", 5)
    header = Header(Op.PUSHPULL, 0, "W0", [Entry.bare("w", 0, 0, (4,))], {"home": 1})
    header.id = requests.add(handle, "S1", lambda h, p: copied.append((h.op, h.meta.get("held"))),
                             message=(header, []))
    handle._arm()
    return handle, header


def _value(request_id, **meta):
    return Header(Op.VALUE, request_id, "S1", [Entry.of("w", 0, np.ones(4, np.float32))], meta)


def test_the_values_are_copied_at_once_and_the_call_ends_with_the_acknowledgement():
    requests, copied = Requests(keep_data=True), []
    handle, header = _pushpull(requests, copied)
    assert requests.answer(_value(header.id, held=True), [np.ones(4, np.float32)])
    assert copied == [(Op.VALUE, True)] and not handle.done()
    assert requests.answer(Header(Op.ACK, header.id, "S1"), [])
    assert handle.done() and handle.succeeded() and copied[-1] == (Op.ACK, None)
    assert not requests.answer(Header(Op.ACK, header.id, "S1"), [])     # answered once


def test_a_head_that_dies_between_the_two_is_asked_again_and_its_successor_answers():
    requests, copied = Requests(keep_data=True), []
    handle, header = _pushpull(requests, copied)
    requests.answer(_value(header.id, held=True), [np.ones(4, np.float32)])
    [(peer, again, _)] = requests.redirect("S1", lambda h: "S2")
    assert peer == "S2" and again.id == header.id and not handle.done()
    requests.answer(_value(header.id), [np.ones(4, np.float32)])          # S2: values and answer at once
    assert handle.succeeded() and copied == [(Op.VALUE, True), (Op.VALUE, None)]


def test_values_that_cannot_be_copied_end_the_call_with_the_error():
    requests = Requests(keep_data=True)
    handle = Handle("pushpull", 5)
    header = Header(Op.PUSHPULL, 0, "W0", [], {"home": 1})

    def broken(h, p):
        raise ValueError("reply for key 'w' is float64")
    header.id = requests.add(handle, "S1", broken, message=(header, []))
    handle._arm()
    requests.answer(_value(header.id, held=True), [np.ones(4, np.float32)])
    assert handle.done() and not handle.succeeded()
    assert requests.redirect("S1", lambda h: "S2") == []                   # nothing left to send again
    with pytest.raises(ValueError, match="float64"):
        handle.wait()
