"""kvps/kvstore/order.py: which way a call goes (its lane or the I/O thread) and what it waits for
first, so that a key's calls keep their order."""
import threading

from kvps.kvstore.order import Order
from kvps.wire.lane import LaneHandle
from kvps.wire.requests import Handle


class FakeLane:
    """Stands in for a Lane: waiting for one of its handles answers it (and records the wait)."""

    def __init__(self):
        self.waited = []

    def poll(self):
        pass

    def pump(self, handle, timeout):
        self.waited.append(handle.what)
        handle._complete()
        return True


def lane_handle(lane, what):
    h = LaneHandle(what, 1.0, (), lane)
    h._expect(1, "S0")
    h._arm()
    return h


def io_handle(what):
    h = Handle(what, 1.0)
    h._expect(1, "S0")
    h._arm()
    return h


def test_a_call_with_nothing_before_goes_its_own_way():
    order, lane = Order(), FakeLane()
    assert order.route(["k"], lane) is lane
    assert order.route(["k"], None) is None


def test_a_small_call_follows_its_key_onto_the_io_path_without_waiting():
    order, lane = Order(), FakeLane()
    io = io_handle("push k")
    order.sent(["k"], io)
    assert order.route(["k", "other"], lane) is None
    assert not io.done() and lane.waited == []
    io._answered(1)                       # answered: the key is free for the lane again
    assert order.route(["k"], lane) is lane


def test_calls_on_one_lane_go_on_without_waiting():
    order, lane = Order(), FakeLane()
    order.sent(["k"], lane_handle(lane, "push k"))
    assert order.route(["k"], lane) is lane
    assert lane.waited == []


def test_a_big_call_waits_for_its_keys_lane_requests():
    order, lane = Order(), FakeLane()
    order.sent(["k"], lane_handle(lane, "push k"))
    order.sent(["j"], lane_handle(lane, "push j"))
    assert order.route(["k", "x"], None) is None
    assert lane.waited == ["push k"]      # only the request naming one of its keys


def test_a_call_on_another_threads_lane_waits_for_it_first():
    order, mine, theirs = Order(), FakeLane(), FakeLane()
    order.sent(["k"], lane_handle(theirs, "push k"))
    assert order.route(["k"], mine) is mine
    assert theirs.waited == ["push k"]


def test_a_key_waiting_on_both_ways_goes_by_the_io_path_after_its_lane_request():
    order, lane = Order(), FakeLane()
    io = io_handle("push a")
    order.sent(["a"], io)
    order.sent(["b"], lane_handle(lane, "push b"))
    assert order.route(["a", "b"], lane) is None
    assert lane.waited == ["push b"] and not io.done()


def test_strict_order_waits_for_every_earlier_request():
    order, lane = Order(strict=True), FakeLane()
    io = io_handle("push a")
    order.sent(["a"], io)
    order.sent(["b"], lane_handle(lane, "push b"))
    io._answered(1)
    assert order.route(["a", "b"], lane) is None
    assert lane.waited == ["push b"]


def test_answered_requests_are_forgotten():
    order = Order()
    io = io_handle("push k")
    order.sent(["k"], io)
    io._answered(1)
    order.route(["k"], None)
    assert order._last == {}


def test_a_request_read_out_of_server_memory_is_waited_for_by_the_next_call_on_its_keys():
    # its reply is copied out of the server's value when it arrives; until then no later call naming
    # the key may go, whichever way, or it could close the round that changes that value
    order, lane = Order(), FakeLane()
    pulled = lane_handle(lane, "pull k")
    order.sent(["k"], pulled, reads=True)
    assert order.route(["k"], lane) is lane
    assert lane.waited == ["pull k"]
    io = io_handle("pull j")
    order.sent(["j"], io, reads=True)
    order.sent(["i"], io_handle("push i"))

    timer = threading.Timer(0.05, io._answered, (1,))
    timer.start()
    assert order.route(["j"], None) is None and io.done()       # waited on the same path too
    assert order.route(["i"], None) is None                     # a plain request is not waited for
    timer.join()


def test_take_front_gives_each_ready_item_to_one_thread_only():
    """Threads taking from one deque of handles: each ready item is taken once, none that is not
    ready, and the order of what is left is kept."""
    import collections
    import threading
    from kvps.wire.requests import take_front
    for _ in range(20):
        queue = collections.deque(range(2000))
        taken = [[] for _ in range(4)]

        def take(mine):
            while (item := take_front(queue, lambda i: i < 1500)) is not None:
                mine.append(item)
        threads = [threading.Thread(target=take, args=(t,)) for t in taken]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        got = sorted(i for t in taken for i in t)
        assert got == list(range(1500)) and list(queue) == list(range(1500, 2000))
