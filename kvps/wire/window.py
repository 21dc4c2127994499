"""A server's window of recent request ids per client: each request is handled once.

A worker resends a request it got no reply to (kvps/wire/requests.py), and a faulty network may
deliver one twice (kvps/wire/faults.py), so a server can receive the same request id more than
once. The window remembers, per client, the last WINDOW ids and what became of each:

    window = Window()
    state = window.admit(client, request_id)    # NEW: handle it; BUSY: drop it (a reply is coming);
                                                # OLD: drop it (answered long ago); else the reply
    window.answered(client, request_id, reply)  # a Header to send again, or RECOMPUTE

A request whose reply carries no values (ACK, ERROR: a push, an init) keeps its reply header, so
a duplicate of it is answered again and never applied twice. A reply with values (a pull) is not
kept (it may be large): its duplicate is recomputed (for PUSHPULL, only the pull). A client is a
(name, routing id) pair, so a replacement worker with the same name starts a fresh window; at most
MAX_CLIENTS windows are kept (the least recently used go first), and ids at or below the highest
id a window has evicted count as OLD.
"""
import collections

WINDOW = 1024                   # request ids remembered per client
MAX_CLIENTS = 1024              # clients remembered

NEW, BUSY, OLD, RECOMPUTE = "new", "busy", "old", "recompute"


class Window:
    """Request ids seen per client, and their replies (see the module docstring)."""

    def __init__(self, size=WINDOW, max_clients=MAX_CLIENTS):
        self.size = size
        self.max_clients = max_clients
        self._clients = collections.OrderedDict()      # client -> [OrderedDict id -> state, floor]
        self.duplicates = 0                            # requests seen again

    def admit(self, client, request_id):
        """NEW (and the id is now BUSY), BUSY, OLD, RECOMPUTE or the reply Header to send again.
        Id 0 (a peer that numbers nothing) is always NEW and never remembered."""
        if not request_id:
            return NEW
        seen = self._clients.get(client)
        if seen is None:
            seen = self._clients[client] = [collections.OrderedDict(), 0]
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        ids, floor = seen
        state = ids.get(request_id)
        if state is None:
            if request_id <= floor:
                self.duplicates += 1
                return OLD
            ids[request_id] = BUSY
            while len(ids) > self.size:
                old, _ = ids.popitem(last=False)
                seen[1] = max(seen[1], old)
            return NEW
        self.duplicates += 1
        if state is RECOMPUTE:
            ids[request_id] = BUSY          # recomputing: a third copy meanwhile is dropped
        return state

    def answered(self, client, request_id, reply):
        """The reply to a request went out: a Header to keep, or RECOMPUTE."""
        seen = self._clients.get(client)
        if seen is not None and request_id in seen[0]:
            seen[0][request_id] = reply

    def forget(self, name):
        """Drop the windows of every client with this name (a worker removed from the job)."""
        for client in [c for c in self._clients if c[0] == name]:
            del self._clients[client]

    def export(self, clients):
        """[(client, floor, ids answered without values, ids to recompute)] of these clients, for
        a server that takes over their requests (chain replication's handover). An id still being
        handled counts as answered: the state handed over holds it."""
        out = []
        for client in clients:
            seen = self._clients.get(client)
            if seen is not None:
                ids, floor = seen
                out.append((client, floor, [i for i, state in ids.items() if state is not RECOMPUTE],
                            [i for i, state in ids.items() if state is RECOMPUTE]))
        return out

    def adopt(self, client, floor, answered, recompute, reply):
        """Take a client's window from export(); reply(id) makes the Header its answered ids get again."""
        ids = collections.OrderedDict((i, reply(i)) for i in answered[-self.size:])
        ids.update((i, RECOMPUTE) for i in recompute[-self.size:])
        self._clients[client] = [ids, floor]
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)

    def clients(self):
        """Every client with a window (least recently used first)."""
        return list(self._clients)
