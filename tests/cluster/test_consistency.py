"""Consistency modes on real jobs on 127.0.0.1: dist_ssp waits, backup workers drop the slow
worker's pushes, the staleness histogram in server_stats; timestamps checked with room for noise."""

import numpy as np
import zmq

import kvps
from kvps.wire import protocol
from kvps.ps.consistency import Consistency, total_staleness
from kvps.wire.protocol import Entry, Header, Op
from kvps.ps.store import Store

SSP_SCRIPT = r'''
import json, os, time, numpy as np, kvps
kv = kvps.create(os.environ["KVTYPE"])
r = kv.rank
kv.init("w", np.zeros(4, np.float32))
out = np.zeros(4, np.float32)
kv.barrier()
for clock in range(1, int(os.environ["STEPS"]) + 1):
    if r == 1:
        time.sleep(float(os.environ["SLOW"]))
    pushed = time.time()
    kv.push("w", np.ones(4, np.float32))
    kv.pull("w", out=out)
    print(json.dumps({"clock": clock, "pushed": pushed, "pulled": time.time(), "value": float(out[0])}),
          flush=True)
kv.barrier()
if r == 0:
    print(json.dumps({"stats": kv.server_stats()}), flush=True)
'''


def test_ssp_fast_worker_waits_for_the_slow_one(cluster):
    steps, slow = 5, 0.3
    c = cluster(2, 1)
    fast, lagging = c.run_workers(SSP_SCRIPT, env={"KVTYPE": "dist_ssp:1", "STEPS": str(steps),
                                                   "SLOW": str(slow)})
    stats = fast.pop()["stats"]["S0"]
    w0 = {line["clock"]: line for line in fast}
    w1 = {line["clock"]: line for line in lagging}
    for clock in range(2, steps + 1):
        # W0's pull at clock c returns only after W1 pushed clock c - 1 ...
        assert w0[clock]["pulled"] >= w1[clock - 1]["pushed"] - 0.01, (clock, w0, w1)
        assert w0[clock]["value"] >= 2 * clock - 1, (clock, w0)
    # ... but it need not wait for W1's clock c (that would be sync): W1 is 0.3 s slower per step
    ahead = sum(w0[k]["pulled"] < w1[k]["pushed"] for k in range(1, steps + 1))
    assert ahead >= steps - 1, (w0, w1)
    for clock, line in w1.items():
        assert line["value"] >= 2 * clock        # the slow worker never waits; W0 is ahead
    assert stats["mode"] == "ssp:1" and stats["ssp_waits"] >= steps - 2, stats
    assert sum(stats["staleness"]) == stats["pushes"] == 2 * steps
    assert c.wait_daemons() == [0, 0]


BACKUP_SCRIPT = r'''
import json, os, time, numpy as np, kvps
kv = kvps.create("dist_sync:backup=1")
r = kv.rank
kv.init("w", np.ones(8, np.float32))
kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0, rescale_grad=-1.0))   # value += sum of the round
out = np.zeros(8, np.float32)
seen = []
# W0 and W1 make 20 quick steps (about 1 s); W2 makes 6 slow ones, most while they run
for step in range(6 if r == 2 else 20):
    time.sleep(0.25 if r == 2 else 0.05)
    kv.pushpull("w", np.ones(8, np.float32), out=out)
    seen.append(float(out[0]))
last = kv.join()        # the fast workers count as pushing zeros, so the slow one's last rounds close
kv.pull("w", out=out)
print(json.dumps({"seen": seen, "final": out.tolist(), "stats": kv.server_stats() if r == 0 else None}),
      flush=True)
'''


def test_backup_workers_drop_the_slow_workers_pushes(cluster):
    c = cluster(3, 1)
    results = c.run_workers(BACKUP_SCRIPT)
    stats = results[0][0]["stats"]["S0"]
    finals = {tuple(lines[0]["final"]) for lines in results}
    assert len(finals) == 1, finals                      # every worker ends with the same value
    final = finals.pop()[0]
    assert stats["mode"] == "sync:backup=1" and stats["pushes"] == 2 * 20 + 6
    # W2 pulls, sleeps while the others close rounds, and pushes a gradient for an old round
    assert stats["dropped"] >= 2 and stats["rounds"] >= 10, stats
    # every accepted push was applied exactly once, no dropped one at all
    assert final == 1 + stats["pushes"] - stats["dropped"], stats
    assert sum(stats["staleness"]) == stats["pushes"] - stats["dropped"]
    for lines in results:
        seen = lines[0]["seen"]
        assert seen == sorted(seen) and all(v == int(v) for v in seen), seen
    assert c.wait_daemons() == [0, 0]


ASYNC_SCRIPT = r'''
import json, numpy as np, kvps
from kvps.ps.consistency import total_staleness
kv = kvps.create("dist_async")
kv.init("big", np.zeros(3000, np.float32))          # split over both servers
out = np.zeros(3000, np.float32)
for step in range(10):
    kv.push("big", np.ones(3000, np.float32))
    if step % 3 == 0:
        kv.pull("big", out=out)
kv.barrier()
stats = kv.server_stats()
print(json.dumps({"stats": stats, "total": total_staleness(stats)}), flush=True)
'''


def test_async_staleness_histogram_in_server_stats(cluster):
    c = cluster(2, 2, env={"KVPS_BIGARRAY_BOUND": "1000"})
    results = c.run_workers(ASYNC_SCRIPT)
    stats, total = results[0][0]["stats"], results[0][0]["total"]
    assert sorted(stats) == ["S0", "S1"]
    for meta in stats.values():
        assert meta["mode"] == "async" and meta["dropped"] == 0 and meta["ssp_waits"] == 0
        assert sum(meta["staleness"]) == meta["pushes"] == 20, meta
    lists = [stats[s]["staleness"] for s in ("S0", "S1")]
    width = max(map(len, lists))
    assert total == [sum(h[i] for h in lists if i < len(h)) for i in range(width)] and sum(total) == 40
    # a worker pulls every third push, so its own pushes alone make some of them stale
    assert len(total) >= 3, total
    assert c.wait_daemons() == [0, 0, 0]


def test_garbage_mode_in_register_does_not_crash_the_server(cluster):
    c = cluster(1, 1)      # the raw worker sends no heartbeats: all of this takes well under 2 s
    ctx = zmq.Context()
    try:
        sched = ctx.socket(zmq.DEALER)
        sched.setsockopt(zmq.LINGER, 0)
        sched.setsockopt(zmq.RCVTIMEO, 10000)
        sched.connect(f"tcp://{c.address}")
        sched.send_multipart([Header(Op.REGISTER, 1, "?", meta={
            "role": "worker", "host": "127.0.0.1", "port": 1, "pid": 1, "rank": 0,
            "mode": "ssp:banana"}).encode()])
        header, _ = protocol.unpack(sched.recv_multipart())
        assert header.op == Op.MEMBERSHIP and header.meta["mode"] == "ssp:banana"
        server = ctx.socket(zmq.DEALER)
        server.setsockopt(zmq.LINGER, 0)
        server.setsockopt(zmq.RCVTIMEO, 10000)
        server.connect(f"tcp://127.0.0.1:{c.server_ports[0]}")
        for i in (2, 3):     # the server answers, and keeps answering
            server.send_multipart([Header(Op.PULL, i, "W0", [Entry.bare("a", 0, 0, (8,))]).encode()])
            header, _ = protocol.unpack(server.recv_multipart())
            assert header.op == Op.ERROR and header.meta["kind"] == "protocol", header.meta
            assert "S0 cannot serve this job" in header.meta["message"]
            assert "'ssp:banana'" in header.meta["message"]
        sched.send_multipart([Header(Op.FINALIZE, 4, "W0").encode()])
        header, _ = protocol.unpack(sched.recv_multipart())
        assert header.op == Op.ACK
        server.close(0)
        sched.close(0)
    finally:
        ctx.term()
    assert c.wait_daemons() == [0, 0]                    # the job still ends cleanly


def test_too_many_backups_fail_at_create_on_every_worker(cluster):
    c = cluster(2, 1)
    script = ('import json, kvps\n'
              'try:\n'
              '    kvps.create("dist_sync", backup_workers=2)\n'
              'except ValueError as e:\n'
              '    print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)\n')
    for lines in c.run_workers(script, timeout=30):
        assert lines[0]["error"] == "ValueError", lines
        assert "sync:backup=2 asks for 2 backup workers, but the job has 2 workers" in lines[0]["message"]
    assert c.wait_daemons() == [0, 0]
