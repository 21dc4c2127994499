"""Handing a chain's key ranges to a server that joins it (KVPS_REPLICAS; docs/replication.md).

A new `kvps server` that takes a dead server's rank joins the tail of each chain of that rank
(kvps/wire/chains.py). The old tail of each such chain, on the I/O thread between two requests,
sends it one STATE message with everything the chain's ranges hold there:

    header, payloads = state(server, home)      # on the old tail: a copy, taken at once
    take(joiner, header, payloads)              # on the joiner: the slots, as they were

and from then on forwards its copies to it (server/replication.py), so the joiner misses nothing and
applies nothing twice. What travels, per slot: the value, the update rule's state (master weights,
step count, its arrays) and the round and clock counters; the pushes waiting in the open round, in
the order they came, which the joiner pushes again (a deferred copy's place whose values have not
come, server/replication.py, goes as a place that the round's sum from this server fills); and the
window of request ids answered for the range (kvps/wire/window.py), so a request asked again after a
later failure is not applied twice.
The update rule itself goes by name and parameters, as SET_OPTIMIZER sends it: no code travels.
"""
import logging

import numpy as np

from kvps.ps.store import Deferred, Rows
from kvps.errors import ProtocolError
from kvps.wire.protocol import Entry, Header, Op

log = logging.getLogger("kvps.server")


def state(server, home):
    """The STATE message (Header, payload arrays) of home rank `home`'s ranges on `server`."""
    slot_ids = [slot_id for slot_id in server.store.slots if server.homes.get(slot_id, server.rank) == home]
    entries, payloads, slots = [], [], []

    def add(key, part, array):
        array = np.ascontiguousarray(array)
        entries.append(Entry.of(key, part, array))
        payloads.append(array)
    for record, waiting in server.store.handover(slot_ids):
        key, part = record["key"], record["part"]
        add(key, part, record["value"])
        arrays, count = [], None
        if record["opt"] is not None:
            master, count, rule_state = record["opt"]
            if master is not None:
                arrays.append("master")
                add(key, part, master)
            for array in rule_state:
                arrays.append("state" if array is not None else "nostate")
                if array is not None:
                    add(key, part, array)
        for worker, array in waiting:
            if type(array) is Deferred:         # a deferred copy's place (server/replication.py)
                if array.array is None:
                    arrays.append(f"defer {worker}")
                    continue
                array = array.array
            arrays.append(f"push {worker}")
            if isinstance(array, Rows):
                add(key, part, array.values)
                arrays.append("rows")
                add(key, part, array.ids)
            else:
                add(key, part, array)
        slot = {"version": record["version"], "pushes": [[int(w), c] for w, c in record["pushes"]],
                "seen": [[int(w), v] for w, v in record["seen"]], "arrays": arrays}
        if count is not None:
            slot["count"] = count
        slots.append(slot)
    window = [[client[0], floor, answered, recompute] for client, floor, answered, recompute
              in server.window.export([c for c in server.window.clients() if c[1:] == ("home", home)])]
    meta = {"home": home, "slots": slots, "window": window}
    generation, spec = server.optimizer
    if spec is not None:
        meta["optimizer"] = {"generation": generation, **spec}
    return Header(Op.STATE, 0, server.name, entries, meta), payloads


def take(server, header, payloads):
    """Make the slots of a STATE message this server's (the joiner's I/O thread)."""
    meta, home = header.meta, header.meta["home"]
    arrays = iter(server._arrays(header, payloads, need=True))
    optimizer = meta.get("optimizer")
    if optimizer is not None and optimizer["generation"] > server.optimizer[0]:
        spec = {k: v for k, v in optimizer.items() if k != "generation"}
        server.store.set_rule(server.registry.create(spec))
        server.optimizer = (optimizer["generation"], spec)
    adopted, rule_states, total = [], {}, 0
    for slot in meta["slots"]:
        entry, value = _next(arrays, header)
        master, rule_state, waiting = None, [], []
        for kind in slot["arrays"]:
            if kind == "nostate":
                rule_state.append(None)
                continue
            if kind.startswith("defer ") and kind[6:].isdigit() and server.store.deferring:
                waiting.append((int(kind[6:]), Deferred()))
                continue
            _, array = _next(arrays, header)
            if kind == "master":
                master = np.array(array)
            elif kind == "state":
                rule_state.append(np.array(array))
            elif kind.startswith("push "):
                waiting.append((int(kind[5:]), np.array(array)))
            elif kind == "rows" and waiting:
                worker, values = waiting.pop()
                waiting.append((worker, Rows(np.array(array, np.int64), values)))
            else:
                raise ProtocolError(f"STATE from {header.src}: {kind!r} is not an array of a slot")
        counters = {"version": slot["version"], "pushes": slot["pushes"], "seen": slot["seen"]}
        adopted.append((entry, value, counters, waiting))
        if "count" in slot:
            rule_states[(entry.key, entry.part)] = (master, slot["count"], rule_state)
        total += value.nbytes
    if next(arrays, None) is not None:
        raise ProtocolError(f"STATE from {header.src} carries more entries than its slots name")
    if rule_states:
        server.store.restore_optimizer(rule_states, (f"the handover from {header.src}", optimizer and optimizer["name"]))
    for entry, value, counters, waiting in adopted:
        server.store.adopt(entry.key, entry.part, value, counters, waiting)
        server.homes[(entry.key, entry.part)] = home
    for worker, floor, answered, recompute in meta["window"]:
        server.window.adopt((worker, "home", home), floor, answered, recompute,
                            lambda i: Header(Op.ACK, i, server.name))
    log.warning("%s: took over the ranges of S%d from %s: %d slots, %d bytes of values", server.name, home,
                header.src, len(adopted), total)


def _next(arrays, header):
    item = next(arrays, None)
    if item is None:
        raise ProtocolError(f"STATE from {header.src} names more arrays than it carries")
    return item
