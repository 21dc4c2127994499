"""The order a worker's data messages leave in: highest priority first, within a byte credit window
(ByteScheduler's and BytePS's scheduling), so a tensor needed soon overtakes bulk already queued.

zmq takes whatever it is given into its own unbounded queue, so an order can only be chosen before
a message is handed over. The Van's I/O thread therefore hands data messages to zmq only while
fewer than `credit` bytes are handed over and not yet written to the kernel (zmq frees a zero-copy
frame then; the Van learns it through the frame's finalizer); the rest wait here by priority. One
message bigger than the window still goes when nothing else is in flight, so nothing starves.

Reordering must never change what a server computes, so a message never overtakes an earlier one
to the same peer that names one of its keys (a pull after a push of that key, a push after an
init): it inherits that message's place instead. A message sent without a priority (a control
message, such as SET_OPTIMIZER) keeps its place among the messages to its peer: after everything
already waiting for it, and before everything sent to it later.

    schedule = Schedule(credit=8 << 20)
    schedule.add(peer, priority, keys, nbytes, item)   # I/O thread
    for item, nbytes in schedule.ready(inflight):      # what may be handed to zmq now, best first
        ...
"""
import heapq
import itertools


class Schedule:

    def __init__(self, credit):
        self.credit = max(int(credit), 1)
        self._heap = []                  # (rank, peer, keys, nbytes, item); rank = (-priority, seq)
        self._seq = itertools.count()
        self._last = {}                  # (peer, key) -> rank of the latest waiting message naming it
        self._peers = {}                 # peer -> [waiting count, highest rank waiting]
        self._floor = {}                 # peer -> rank of its latest waiting control message

    def __len__(self):
        return len(self._heap)

    def holds(self, peer):
        """Whether messages to `peer` are waiting."""
        return peer in self._peers

    def add(self, peer, priority, keys, nbytes, item):
        """Queue a message; priority None: after everything waiting for `peer` (order kept)."""
        seq = next(self._seq)
        waiting = self._peers.get(peer)
        if priority is None:
            rank = (waiting[1][0], seq) if waiting else (float("-inf"), seq)
        else:
            rank = (-priority, seq)
            earlier = [self._last.get((peer, key)) for key in keys] + [self._floor.get(peer)]
            for e in earlier:
                if e is not None and e[0] > rank[0]:
                    rank = (e[0], seq)                # just after it: same class, later sequence
        if priority is None:
            self._floor[peer] = rank
        for key in keys:
            self._last[(peer, key)] = rank
        if waiting is None:
            self._peers[peer] = [1, rank]
        else:
            waiting[0] += 1
            waiting[1] = max(waiting[1], rank)
        heapq.heappush(self._heap, (rank, peer, keys, nbytes, item))

    def ready(self, inflight):
        """Pop the waiting messages that fit the window with `inflight` bytes already handed over,
        best first: [(item, nbytes)]."""
        out = []
        while self._heap:
            nbytes = self._heap[0][3]
            if inflight and inflight + nbytes > self.credit:
                break
            out.append(self._pop())
            inflight += nbytes
        return out

    def drain(self):
        """Everything still waiting, in order (at stop): [(item, nbytes)]."""
        return [self._pop() for _ in range(len(self._heap))]

    def _pop(self):
        rank, peer, keys, nbytes, item = heapq.heappop(self._heap)
        for key in keys:
            if self._last.get((peer, key)) == rank:
                del self._last[(peer, key)]
        if self._floor.get(peer) == rank:
            del self._floor[peer]
        waiting = self._peers[peer]
        waiting[0] -= 1
        if not waiting[0]:
            del self._peers[peer]
        return item, nbytes
