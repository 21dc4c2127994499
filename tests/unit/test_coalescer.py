"""The Coalescer's rules (kvps/kvstore/coalesce.py), without sockets: which pushes join the open
batch, and when the I/O thread's check sends it."""
import threading
import time

import numpy as np
import pytest

from kvps.kvstore.base import KeyInfo
from kvps.kvstore.coalesce import Batch, Coalescer, Joined
from kvps.wire.requests import Handle
from kvps.wire.protocol import Op

pytestmark = pytest.mark.unit


class Later:
    """Van.call_later, by hand: what was asked, run when the test says."""

    def __init__(self):
        self.asked = []

    def __call__(self, delay, fn):
        self.asked.append((delay, fn))

    def run(self):
        asked, self.asked = self.asked, []
        for _, fn in asked:
            fn()


def batch_of(op, keys, nbytes=40, call=Op.PUSH):
    batch = Batch(op, messages=None, call=call)
    batch.add([(KeyInfo(k, np.dtype(np.float32), (nbytes // 4,)), np.zeros(nbytes // 4, np.float32)) for k in keys],
              priority=0, start=time.time())
    return batch


def test_a_push_joins_a_batch_of_the_same_op_other_keys_and_room_left():
    later = Later()
    c = Coalescer(0.001, limit=100, later=later)
    assert c.fits(Op.PUSH, [1], 40)                 # nothing open
    c.open(batch_of(Op.PUSH, [1, 2]), send=lambda late: True)
    assert later.asked and later.asked[0][0] == 0.001
    assert c.fits(Op.PUSH, [3], 20)
    assert not c.fits(Op.PUSH, [3], 21)            # 80 + 21 bytes > 100
    assert not c.fits(Op.PUSHPULL, [3], 4)          # another op
    assert not c.fits(Op.PUSH, [2], 4)              # key 2 waits already: a round takes one push of it
    batch = c.take()
    assert batch.keys == {1, 2} and batch.nbytes == 80 and batch.send is None and c.batch is None


def test_priorities_and_starts_of_the_pushes_a_batch_stands_for():
    batch = Batch(Op.PUSH, messages=None)
    info = KeyInfo(0, np.dtype(np.float32), (1,))
    batch.add([(info, np.zeros(1, np.float32))], priority=-3, start=10.0)
    batch.add([(KeyInfo(1, np.dtype(np.float32), (1,)), np.zeros(1, np.float32))], priority=-1, start=11.0)
    assert batch.priority == -1 and batch.starts == [10.0, 11.0]


def test_the_check_sends_a_due_batch_and_looks_again_at_one_not_due_or_not_ready():
    later, sent = Later(), []
    c = Coalescer(0.05, limit=1000, later=later)
    ready = [False]

    def send(late):
        if not ready[0]:
            return False
        sent.append(late)
        c.take()
        return True
    c.open(batch_of(Op.PUSH, [1]), send)
    later.run()                                     # at once: not due yet, asks again for the time left
    assert sent == [] and len(later.asked) == 1 and 0 < later.asked[0][0] <= 0.05
    time.sleep(0.06)
    later.run()                                     # due, but a request its keys wait on is unanswered
    assert sent == [] and later.asked[0][0] == 0.05
    ready[0] = True
    later.run()
    assert sent == [True] and c.batch is None and later.asked == []
    later.run()                                     # nothing open: nothing to do


def test_one_check_at_a_time_and_none_once_calls_stop():
    """Arming a check from the caller's thread wakes the I/O thread (about as dear as a small call):
    a batch opened while a check is due asks for none; a check that finds no batch open but calls
    made since looks again (from the I/O thread, no wake-up); once calls stop it stops."""
    later = Later()
    c = Coalescer(0.001, limit=1000, later=later)

    def call_and_wait():
        c.open(batch_of(Op.PUSHPULL, [1], call=Op.PUSHPULL), send=lambda late: True)
        c.take()                                    # its wait sent it
    call_and_wait()
    assert len(later.asked) == 1
    call_and_wait()
    call_and_wait()
    assert len(later.asked) == 1                    # still the first one
    later.run()                                     # nothing open, but calls went on: again
    assert len(later.asked) == 1
    later.run()                                     # no call since: no more checks
    assert later.asked == []
    c.open(batch_of(Op.PUSHPULL, [2], call=Op.PUSHPULL), send=lambda late: c.take() is not None)
    assert len(later.asked) == 1                    # the next batch arms one again
    time.sleep(0.002)
    later.run()                                     # due: sent late
    assert c.batch is None and later.asked == []
    c.open(batch_of(Op.PUSHPULL, [3], call=Op.PUSHPULL), send=lambda late: True)
    assert len(later.asked) == 1                    # a late send disarmed it


def test_a_check_that_fails_leaves_none_armed():
    later = Later()
    c = Coalescer(0.0, limit=1000, later=later)

    def broken(late):
        raise RuntimeError("send failed")
    c.open(batch_of(Op.PUSH, [1]), broken)
    with pytest.raises(RuntimeError):
        later.run()
    c.take()
    c.open(batch_of(Op.PUSH, [2]), lambda late: True)
    assert len(later.asked) == 1                    # the next batch is looked at again


def test_the_check_never_waits_for_a_caller_inside_a_call():
    later, sent = Later(), []
    c = Coalescer(0.0, limit=1000, later=later)
    c.open(batch_of(Op.PUSH, [1]), lambda late: sent.append(late) or True)
    inside, leave = threading.Event(), threading.Event()

    def caller():
        with c.lock:
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=caller)
    t.start()
    inside.wait(10)
    start = time.monotonic()
    later.run()                                     # the lock is held: ask again, at once
    assert time.monotonic() - start < 0.5 and sent == [] and len(later.asked) == 1
    leave.set()
    t.join(10)
    later.run()
    assert sent == [True]


def test_send_open_sends_what_waits_at_exit():
    later, sent = Later(), []
    c = Coalescer(1.0, limit=1000, later=later)
    c.send_open()                                   # nothing open
    c.open(batch_of(Op.PUSHPULL, [1]), lambda late: sent.append(late) or True)
    c.send_open()
    assert sent == [False]


def test_async_pushpulls_and_pushes_never_share_a_batch():
    c = Coalescer(0.001, limit=100, later=Later())
    c.open(batch_of(Op.PUSHPULL, [1], call=Op.PUSHPULL), send=lambda late: True)
    assert c.fits(Op.PUSHPULL, [2], 20, call=Op.PUSHPULL)
    assert not c.fits(Op.PUSHPULL, [2], 20)         # a pulled-ahead push goes as PUSHPULL, but is a push
    assert not c.fits(Op.PUSH, [2], 20)
    assert not c.fits(Op.PUSHPULL, [1], 20, call=Op.PUSHPULL)


def test_waiting_on_a_joined_call_sends_its_batch_once_then_waits_for_the_batch():
    c = Coalescer(1.0, limit=1000, later=Later())
    batch = batch_of(Op.PUSHPULL, [1, 2], call=Op.PUSHPULL)
    sent = []

    def send(late, waited=False):
        sent.append((late, waited))
        c.take()
        batch.handle = Handle.completed("pushpull of keys 1, 2")
        return True
    c.open(batch, send)
    first, second = Joined(batch, "pushpull of key 1", c.lock), Joined(batch, "pushpull of key 2", c.lock)
    assert not first.done() and not first.succeeded()       # done() only looks: nothing is sent
    assert sent == []
    assert first.wait() is first and sent == [(False, True)] and c.batch is None     # sent by a wait
    assert second.done() and second.succeeded()
    second.wait()
    assert sent == [(False, True)]                          # sent once, for both


def test_a_joined_call_raises_its_batchs_error():
    batch = batch_of(Op.PUSHPULL, [1], call=Op.PUSHPULL)
    batch.handle = Handle.failed("pushpull of key 1", ValueError("refused by S0"))
    joined = Joined(batch, "pushpull of key 1", threading.RLock())
    assert joined.done() and not joined.succeeded()
    with pytest.raises(ValueError, match="refused by S0"):
        joined.wait()
