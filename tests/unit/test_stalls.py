"""The stall check of a sync server (server/stalls.py), on a store in process: a round that waits
past the delay for a live worker is named once, with the worker it waits for; rounds that close,
and workers that joined, are not."""
import logging

import numpy as np

from kvps.ps.store import Store
from server.stalls import Stalls


def _store(keys, workers=3):
    store = Store(workers, "sync")
    for key in keys:
        store.init(0, key, 0, np.float32, (2,), np.zeros(2, np.float32), lambda r: None)
    return store


def _push(store, worker, key):
    store.push(worker, key, 0, np.ones(2, np.float32), lambda r: None)


def test_a_round_waiting_past_the_delay_is_named_once(caplog):
    store = _store(["w", "b"])
    stalls = Stalls(store, "S0", after_s=60.0)
    for w in (1, 2):
        _push(store, w, "w")            # W0 has not pushed "w"
    with caplog.at_level(logging.WARNING, logger="kvps.server"):
        stalls.check(now=0.0)
        stalls.check(now=59.0)
        assert not caplog.records
        stalls.check(now=61.0)
        stalls.check(now=90.0)
    (record,) = caplog.records
    assert record.getMessage().startswith("S0: the sync round of key 'w' (round 1) has waited over 60 s for W0 "
                                          "(W1, W2 pushed)"), record.getMessage()


def test_rounds_that_close_or_only_wait_for_joined_workers_are_not_named(caplog):
    store = _store(["w"])
    stalls = Stalls(store, "S0", after_s=10.0)
    _push(store, 1, "w")
    with caplog.at_level(logging.WARNING, logger="kvps.server"):
        stalls.check(now=0.0)
        for w in (0, 2):
            _push(store, w, "w")        # the round closes; the next one opens and waits anew
        _push(store, 1, "w")
        stalls.check(now=5.0)
        stalls.check(now=12.0)          # the new round has waited 7 s
        assert not caplog.records
        store.worker_joined(0)          # W0 is done (kv.join): it counts as pushing zeros
        stalls.check(now=40.0)
    (record,) = caplog.records
    assert "has waited over 10 s for W2 (W1 pushed)" in record.getMessage(), record.getMessage()
