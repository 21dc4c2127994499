"""The timeline writer (kvps/metrics/timeline.py) and `kvps timeline merge` (kvps/tools/timeline): the
merged file is a Chrome trace (schema below), one process per node, clocks moved by each node's offset."""
import json

from kvps.metrics.timeline import Timeline, flow_id
from kvps.tools.timeline import main as timeline_main, merge

PHASES = {"X", "i", "s", "f", "M"}


def check_schema(trace):
    """What chrome://tracing and Perfetto need of the JSON object format."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    names = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str) and e["name"], e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name"), e
            if e["name"] == "process_name":
                names[e["pid"]] = e["args"]["name"]
            continue
        assert isinstance(e["ts"], int) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
        if e["ph"] in ("s", "f"):
            assert isinstance(e["id"], int), e
        assert isinstance(e.get("args", {}), dict)
    assert {e["pid"] for e in trace["traceEvents"]} <= set(names), "an event's process has no name"
    return names


def test_merge_makes_one_process_per_node_on_the_schedulers_clock(tmp_path):
    a = Timeline(str(tmp_path), "worker")
    a.name("W0")
    a.offset(0.5, rtt=0.001)          # the scheduler's clock is 0.5 s ahead of this node's
    a.offset(9.0, rtt=0.1)            # a worse sample (longer round trip) is ignored
    a.complete("push", "call", 100.0, 100.25, {"keys": ["w"], "bytes": 16})
    a.flow("s", flow_id("W0", 7), "request", 100.0)
    a.close()
    b = Timeline(str(tmp_path), "server")
    b.name("S0")
    b.complete("push", "request", 100.55, 100.6, {"src": "W0", "req": 7})
    b.flow("f", flow_id("W0", 7), "request", 100.55)
    b.close()
    assert len(list(tmp_path.glob("*.jsonl"))) == 2       # one file per process (here: per role)
    trace, skipped = merge(str(tmp_path))
    names = check_schema(trace)
    assert skipped == 0
    assert sorted(n.split()[0] for n in names.values()) == ["S0", "W0"]
    by_name = {e["cat"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    # W0's push starts at 100.0 + 0.5 on the common clock, the server's request at 100.55: 50 ms later
    assert by_name["request"]["ts"] - by_name["call"]["ts"] == 50_000
    assert by_name["call"]["dur"] == 250_000
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert {e["id"] for e in flows} == {flow_id("W0", 7)} and len(flows) == 2


def test_merge_skips_torn_lines_and_the_cli_writes_the_file(tmp_path, capsys):
    tl = Timeline(str(tmp_path / "tl"), "worker")
    tl.name("W1")
    tl.instant("sent", "wire", 5.0, {"peer": "S0", "req": 1})
    tl.close()
    path = next((tmp_path / "tl").iterdir())
    with open(path, "a") as f:
        f.write('{"ph": "X", "name": "cut off at a kill')
    out = tmp_path / "trace.json"
    assert timeline_main(["merge", str(tmp_path / "tl"), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    check_schema(trace)
    assert trace["otherData"]["skipped_lines"] == 1
    assert "1 events from 1 nodes (W1)" in capsys.readouterr().out


def test_merge_refuses_an_empty_directory(tmp_path, capsys):
    assert timeline_main(["merge", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 2
    assert "holds no .jsonl timeline files" in capsys.readouterr().err
