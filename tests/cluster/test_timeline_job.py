"""The timeline of a real job (KVPS_TIMELINE=DIR, then `kvps timeline merge`): a Chrome trace with one
process per node, in which each push's events come in causal order across nodes on the common clock:
the worker's call starts, its request leaves for zmq, the server receives it and replies, the call ends."""
import json

from tests.harness import PY, Cluster, run_command
from tests.unit.test_timeline import check_schema

SLACK_US = 2000         # the clock offsets are estimated within half a heartbeat's round trip

WORKER = """
import numpy as np, kvps
kv = kvps.create("dist_sync")
w = np.zeros(1000, np.float32)
kv.init("w", w)
for _ in range(10):
    kv.push("w", np.ones(1000, np.float32), priority=3)
    kv.pull("w", out=w)
kv.close()
"""


def test_a_jobs_timeline_merges_into_one_trace_in_causal_order(tmp_path):
    directory = tmp_path / "tl"
    with Cluster(tmp_path, workers=1, servers=1, env={"KVPS_TIMELINE": str(directory)}) as c:
        c.run_workers(WORKER, timeout=60)
        assert c.wait_daemons() == [0, 0], c.logs()
    out = tmp_path / "trace.json"
    result = run_command([PY, "-m", "kvps.cli", "timeline", "merge", str(directory), "-o", str(out)], tmp_path, 60)
    assert result.returncode == 0, result.stdout + result.stderr
    trace = json.loads(out.read_text())
    names = check_schema(trace)
    assert [n.split()[0] for n in names.values()] == ["H", "S0", "W0"]      # scheduler, servers, workers
    node = {pid: name.split()[0] for pid, name in names.items()}
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    served = {(e["args"]["src"], e["args"]["req"]): e for e in events
              if e["ph"] == "X" and e["cat"] == "request" and node[e["pid"]] == "S0"}
    sent = {(node[e["pid"]], e["args"]["req"]): e for e in events if e["ph"] == "i" and e["name"] == "sent"}
    calls = [e for e in events if e["ph"] == "X" and e["cat"] == "call" and e["name"] in ("push", "pushpull")]
    assert len(calls) >= 10, "every push is on the timeline"
    assert {"round", "sum"} <= {e["name"] for e in events if node[e["pid"]] == "S0"}
    checked = 0
    for call in calls:
        worker = node[call["pid"]]
        assert call["args"]["priority"] == 3 and call["args"]["keys"] == ["w"] and call["args"]["bytes"] == 4000
        for request in call["args"]["requests"]:
            req = int(request.split("/")[1])
            server, out_event = served[(worker, req)], sent[(worker, req)]
            start, end = call["ts"], call["ts"] + call["dur"]
            assert start <= out_event["ts"] <= server["ts"] + SLACK_US, (call, out_event, server)
            assert start - SLACK_US <= server["ts"] <= server["ts"] + server["dur"] <= end + SLACK_US, (call, server)
            checked += 1
    assert checked >= 10
    flows = [e for e in events if e["ph"] in ("s", "f")]
    starts = {e["id"] for e in flows if e["ph"] == "s"}
    assert starts and starts <= {e["id"] for e in flows if e["ph"] == "f"}, "every request's flow arrives"


TORCH_WORKER = """
import json, torch, kvps.torch as kt
torch.manual_seed(0)
kv = kt.init("sync")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), bucket_bytes=300)
x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
keys = dict(zip(opt._names, opt._keys))
print(json.dumps({"buckets": [[keys[n] for n in bucket] for bucket in opt.buckets]}), flush=True)
kv.close()
"""


def test_torch_buckets_hook_to_sync_on_the_timeline(tmp_path):
    """Each step's gradient bucket is one slice on its worker, from its last gradient's hook to its
    sync seen complete, around the pushpull call that carried it."""
    directory = tmp_path / "tl"
    with Cluster(tmp_path, workers=1, servers=1, env={"KVPS_TIMELINE": str(directory)}) as c:
        ((line,),) = c.run_workers(TORCH_WORKER, timeout=90)
        assert c.wait_daemons() == [0, 0], c.logs()
    out = tmp_path / "trace.json"
    result = run_command([PY, "-m", "kvps.cli", "timeline", "merge", str(directory), "-o", str(out)], tmp_path, 60)
    assert result.returncode == 0, result.stdout + result.stderr
    trace = json.loads(out.read_text())
    node = {pid: name.split()[0] for pid, name in check_schema(trace).items()}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and node[e["pid"]] == "W0"]
    buckets = [e for e in events if e["cat"] == "torch"]
    keys = line["buckets"]
    assert len(keys) >= 2, keys
    assert [e["name"] for e in buckets] == [f"bucket {b}" for _ in range(3) for b in range(len(keys))]
    calls = [e for e in events if e["cat"] == "call" and e["name"] == "pushpull"]
    for e in buckets:
        b, args = e["args"]["bucket"], e["args"]
        assert e["name"] == f"bucket {b}" and args["keys"] == keys[b] and args["nkeys"] == len(keys[b]), e
        assert args["bytes"] > 0 and 0 <= args["handed_us"] <= e["dur"], e
        start, end = e["ts"], e["ts"] + e["dur"]
        carried = [c for c in calls if set(c["args"]["keys"]) == set(keys[b])
                   and start + args["handed_us"] <= c["ts"] <= c["ts"] + c["dur"] <= end]
        assert len(carried) == 1, (e, [c for c in calls if set(c["args"]["keys"]) == set(keys[b])])
