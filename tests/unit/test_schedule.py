"""The worker's send schedule (kvps.wire.schedule): priority order within a credit window, and the
orders it must keep (same peer and key, messages without a priority)."""

from kvps.wire.schedule import Schedule

MB = 1 << 20


def names(ready):
    return [item for item, _ in ready]


def test_highest_priority_first_and_arrival_order_within_a_priority():
    s = Schedule(credit=100 * MB)
    for name, priority in (("a", 0), ("b", -3), ("c", 5), ("d", 0), ("e", 5)):
        s.add("S0", priority, (name,), MB, name)
    assert names(s.ready(0)) == ["c", "e", "a", "d", "b"]
    assert len(s) == 0


def test_the_window_holds_back_what_does_not_fit_but_one_big_message_still_goes():
    s = Schedule(credit=3 * MB)
    for i in range(4):
        s.add("S0", -i, (i,), 2 * MB, i)
    assert names(s.ready(0)) == [0]              # 2 MB fits; 4 MB would not
    assert names(s.ready(2 * MB)) == []           # the window is full while 2 MB are in flight
    s.add("S0", 9, ("hot",), 1 * MB, "hot")       # arrives while the bulk waits: goes next
    assert names(s.ready(2 * MB)) == ["hot"]
    big = Schedule(credit=MB)
    big.add("S0", 0, ("x",), 10 * MB, "x")
    assert names(big.ready(0)) == ["x"]           # bigger than the window: alone, but it goes


def test_a_message_never_overtakes_an_earlier_one_to_the_same_peer_naming_its_key():
    s = Schedule(credit=100 * MB)
    s.add("S0", -5, ("k",), MB, "push k")
    s.add("S0", 0, ("j",), MB, "push j")
    s.add("S0", 7, ("k",), 0, "pull k")           # higher priority, but must see the push of k
    s.add("S1", 7, ("k",), 0, "pull k from S1")   # another server: free to go first
    assert names(s.ready(0)) == ["pull k from S1", "push j", "push k", "pull k"]


def test_a_message_without_priority_keeps_its_place_among_its_peers_messages():
    s = Schedule(credit=100 * MB)
    s.add("S0", -1, ("a",), MB, "a")
    s.add("S0", 3, ("b",), MB, "b")
    s.add("S0", None, (), 0, "control")
    s.add("S0", 9, ("c",), MB, "c")                # later, even if higher: after the control message
    s.add("S1", 9, ("c",), MB, "c to S1")          # another peer: not held back
    assert s.holds("S0") and s.holds("S1") and not s.holds("S2")
    assert names(s.ready(0)) == ["c to S1", "b", "a", "control", "c"]
    assert not s.holds("S0")


def test_drain_returns_everything_in_order():
    s = Schedule(credit=MB)
    for i in range(3):
        s.add("S0", i, (i,), 4 * MB, i)
    assert names(s.drain()) == [2, 1, 0]
    assert len(s) == 0 and not s.holds("S0")
