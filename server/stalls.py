"""The stall check of a sync server (KVPS_STALL_WARNING; Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS):
a round that has waited that long for workers that are alive is named in a warning, with the
workers it waits for, once per round.

    stalls = Stalls(store, "S0", after_s=60.0)
    van.every(stalls.interval, stalls.check)      # on the I/O thread

A worker that skips a key or a step, or waits in a call the others do not make (kv.barrier or
kv.load under `if kv.rank == 0:`), holds every other worker in its sync rounds. The job then fails
at KVPS_TIMEOUT (300 s); until then the workers' calls say nothing, and only the server knows who
is missing. A worker that dies is another matter: the scheduler names it within
KVPS_HEARTBEAT_TIMEOUT.

The check costs nothing on the message path: every `interval` it walks the slots, and a slot whose
open round has the same version as at the last walks has waited since the first of them.
"""
import logging
import time

log = logging.getLogger("kvps.server")

SHOWN = 4       # keys named in one warning; the rest are counted


class Stalls:
    def __init__(self, store, name, after_s):
        self.store, self.name, self.after_s = store, name, after_s
        self.interval = max(0.05, min(after_s / 4, 5.0))
        self._open = {}             # slot id -> (version of its open round, when a walk first saw it open)
        self._told = set()          # (slot id, version) already named

    def check(self, now=None):
        """Walk the slots (on the store's thread); log the rounds newly past after_s."""
        store = self.store
        if store.mode != "sync":
            return
        now = time.monotonic() if now is None else now
        still, stalled = {}, {}
        for slot in store.slots.values():
            if not slot.in_round:
                continue
            seen = self._open.get(slot.id)
            since = seen[1] if seen is not None and seen[0] == slot.version else now
            still[slot.id] = (slot.version, since)
            if now - since >= self.after_s and (slot.id, slot.version) not in self._told:
                self._told.add((slot.id, slot.version))
                missing = tuple(store.clocks.missing(slot))
                if missing:
                    stalled.setdefault(missing, []).append(slot)
        self._open = still
        self._told = {told for told in self._told if still.get(told[0], (None,))[0] == told[1]}
        for missing, slots in stalled.items():
            log.warning("%s", self.describe(missing, slots))

    def describe(self, missing, slots):
        names = ", ".join(f"{slot.name()} (round {slot.version + 1})" for slot in slots[:SHOWN])
        more = f" and {len(slots) - SHOWN} more" if len(slots) > SHOWN else ""
        waiting = ", ".join(f"W{w}" for w in missing)
        pushed = ", ".join(f"W{w}" for w in sorted(slots[0].in_round))
        return (f"{self.name}: the sync round of {names}{more} has waited over {self.after_s:g} s for {waiting} "
                f"({pushed} pushed): every worker's calls wait with it. A worker that skips a key or a step, or "
                f"waits in a call the others do not make (kv.barrier or kv.load under `if kv.rank == 0:`), "
                f"stalls the job; it fails at KVPS_TIMEOUT (KVPS_STALL_WARNING sets this warning's delay)")
