"""The meta schema of every op (kvps.wire.protocol.SCHEMA): the decoder enforces it, docs/wire.md
shows it, and a hostile header cannot get past the decoder with anything but a ProtocolError.

    python tests/unit/test_wire_schema.py --write     # regenerate docs/wire.md's tables
"""
import pathlib
import sys

import msgpack
import pytest

from kvps.errors import ProtocolError
from kvps.optimizer import SGD
from kvps.ps import compression
from kvps.ps.store import Store
from kvps.wire import protocol
from kvps.wire.protocol import SCHEMA, Entry, Header, Op

DOC = pathlib.Path(__file__).parents[2] / "docs" / "wire.md"
BEGIN = "<!-- generated from kvps.wire.protocol.SCHEMA: python tests/unit/test_wire_schema.py --write -->\n"
END = "<!-- end of generated tables -->\n"


def _raw(op, meta, /, **changes):
    fields = {"v": protocol.VERSION, "op": int(op), "id": 1, "src": "W0", "keys": [], "meta": meta}
    fields.update(changes)
    return msgpack.packb(fields)


def _deep(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_every_op_has_a_schema():
    assert set(SCHEMA) == set(Op)
    for op, message in SCHEMA.items():
        assert message.route and message.meaning, op
        for name, field in protocol._flat(message.meta):
            assert field.meaning, f"{op.name} {name}"


# What the library and the daemons send, built the way they build it.
SENT = [
    (Op.REGISTER, {"mode": "ssp:4", "role": "worker", "host": "10.0.0.2", "port": 40123, "pid": 77, "rank": -1}),
    (Op.REGISTER, {"role": "server", "host": "10.0.0.3", "port": 40124, "pid": 78, "rank": 0}),
    (Op.MEMBERSHIP, {"servers": [["10.0.0.3", 40124, 78]], "workers": [["10.0.0.2", 40123, 77]], "mode": "sync",
                     "rank": 0}),
    (Op.BARRIER, {"group": "workers"}),
    (Op.HEARTBEAT, {}),
    (Op.NODE_FAILED, {"node": "W1", "reason": "no heartbeat from W1 for 10.2 s"}),
    (Op.NODE_LEFT, {"node": "W1", "reason": "it closed its kvstore"}),
    (Op.ACK, {}),
    (Op.ACK, {"last": "W3"}),
    (Op.ERROR, {"kind": "value", "message": "key 'a' was initialised as float32 (8,)"}),
    (Op.PUSH, {}),
    (Op.PUSH, {"codec": compression.check({"type": "2bit", "threshold": 0.5})}),
    (Op.PUSHPULL, {"codec": compression.check({"type": "topk", "ratio": 0.1})}),
    (Op.PUSHPULL, {"codec": compression.check({"type": "fp16"})}),
    (Op.SET_OPTIMIZER, {"generation": 1, "spec": SGD(learning_rate=0.1, momentum=0.9).spec()}),
    (Op.STATS, {}),
    (Op.RING, {"seq": 3, "n": 1000, "phase": "rs", "step": 0, "chunk": 2, "epoch": 0}),
]


@pytest.mark.parametrize("op,meta", SENT, ids=[f"{op.name}-{i}" for i, (op, _) in enumerate(SENT)])
def test_what_nodes_send_decodes(op, meta):
    assert protocol.decode(Header(op, 1, "W0", meta=meta).encode()).meta == meta


def test_the_servers_stats_fit_the_schema():
    stats = Store(2, "ssp:2").stats
    meta = dict(stats, kernels={"sum_into": 3}, backend="numpy", keys=4, mode="ssp:2")
    assert protocol.decode(Header(Op.STATS, 1, "S0", meta=meta).encode()).meta == meta


@pytest.mark.parametrize("op,meta,message", [
    (Op.PUSH, {"x": 1}, "PUSH meta has an unknown field 'x' (PUSH takes codec, shm, done, deferred, home, chain)"),
    (Op.PULL, {"codec": None}, "PULL meta has an unknown field 'codec' (PULL takes into, mapped, done, pull, home)"),
    (Op.VALUE, {"shm": [0, "1"]}, "VALUE meta field 'shm' is [0, '1'], expected list of int"),
    (Op.PUSH, {"shm": [[0, 1]]}, "PUSH meta field 'shm' is [[0, 1]], expected list of [int, int, int]"),
    (Op.PUSH, {7: 1}, "PUSH meta has an unknown field 7"),
    (Op.NODE_FAILED, {"node": "W1", "reason": "x", "left": True}, "NODE_FAILED meta has an unknown field 'left'"),
    (Op.REGISTER, {"role": "worker", "host": "h", "pid": 1}, "REGISTER meta lacks the required field 'port' (int)"),
    (Op.BARRIER, {}, "BARRIER meta lacks the required field 'group' (str)"),
    (Op.REGISTER, {"role": "worker", "host": "h", "port": "80", "pid": 1},
     "REGISTER meta field 'port' is '80', expected int"),
    (Op.REGISTER, {"role": "worker", "host": "h", "port": True, "pid": 1},
     "REGISTER meta field 'port' is True, expected int"),
    (Op.SET_OPTIMIZER, {"generation": 1.0, "spec": {"name": "sgd", "params": {}}},
     "SET_OPTIMIZER meta field 'generation' is 1.0, expected int"),
    (Op.SET_OPTIMIZER, {"generation": 1, "spec": {"name": "sgd", "params": {"lr": [1]}}},
     "SET_OPTIMIZER meta field 'spec' is {'name': 'sgd', 'params': {'lr': [1]}}, "
     "expected map {name: str, params: map of str -> scalar, lr_scheduler?: "),
    (Op.SET_OPTIMIZER, {"generation": 1, "spec": {"name": "sgd", "params": {},
                                                   "lr_scheduler": {"name": "factor", "params": {"step": [1.5]}}}},
     "lr_scheduler?: map {name: str, params: map of str -> scalar or list of int}}"),
    (Op.PUSH, {"codec": {"type": "2bit", "threshold": "0.5"}}, "expected map {type: str, threshold?: float"),
    (Op.PUSH, {"codec": {"threshold": 0.5}}, "PUSH meta field 'codec' is {'threshold': 0.5}, expected map"),
    (Op.MEMBERSHIP, {"rank": 0, "servers": [["h", 1]], "workers": [], "mode": "sync"},
     "MEMBERSHIP meta field 'servers' is [['h', 1]], expected list of [str, int, int]"),
    (Op.STATS, {"staleness": [1, 2.5]}, "STATS meta field 'staleness' is [1, 2.5], expected list of int"),
    (Op.STATS, {"kernels": {1: 2}}, "STATS meta field 'kernels' is {1: 2}, expected map of str -> int"),
])
def test_decode_refuses_meta_that_breaks_the_schema(op, meta, message):
    with pytest.raises(ProtocolError) as info:
        protocol.decode(_raw(op, meta))
    assert message in str(info.value)


def test_error_texts_are_bounded():
    with pytest.raises(ProtocolError) as info:
        protocol.decode(_raw(Op.BARRIER, {"group": "x" * 100_000, "y" * 100_000: 1}))
    assert len(str(info.value)) < 300
    with pytest.raises(ProtocolError) as info:
        protocol.decode(_raw(Op.PUSH, {}, keys=[["k" * 100_000, 0, 0, list(range(1000)), -1]]))
    assert len(str(info.value)) < 300


def _nested_everywhere():
    deep = _deep(1000)
    entry = ["k", 0, 0, [2], 8]
    cases = {name: _raw(Op.PUSH, {}, **{name: deep}) for name in ("v", "op", "id", "src", "keys", "meta")}
    for i, name in enumerate(("key", "part", "dtype", "shape", "nbytes")):
        cases[f"entry {name}"] = _raw(Op.PUSH, {}, keys=[entry[:i] + [deep] + entry[i + 1:]])
    cases["meta codec"] = _raw(Op.PUSH, {"codec": deep})
    cases["meta codec.type"] = _raw(Op.PUSH, {"codec": {"type": deep}})
    cases["meta unknown field"] = _raw(Op.PUSH, {"x": deep})
    cases["meta deep map"] = _raw(Op.SET_OPTIMIZER, {"generation": 1, "spec": {"name": "sgd", "params": {"a": deep}}})
    cases["meta list item"] = _raw(Op.STATS, {"staleness": [0, deep]})
    return cases


@pytest.mark.parametrize("field,frame", list(_nested_everywhere().items()))
def test_deep_nesting_is_a_protocol_error(field, frame):
    """1000 levels of msgpack in any header field: a ProtocolError with a short text, never a
    RecursionError (which would escape the I/O thread's handler)."""
    with pytest.raises(ProtocolError) as info:
        protocol.unpack([frame])
    assert len(str(info.value)) < 300


def test_node_left_is_not_node_failed():
    assert Op.NODE_LEFT != Op.NODE_FAILED
    assert set(SCHEMA[Op.NODE_FAILED].meta) == set(SCHEMA[Op.NODE_LEFT].meta) == {"node", "reason"}


def _generated(text):
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def test_docs_show_the_schema():
    text = DOC.read_text()
    assert _generated(text) == protocol.schema_markdown(), (
        f"{DOC} does not show kvps.wire.protocol.SCHEMA as it is now; regenerate its tables with "
        f"`.venv/bin/python tests/unit/test_wire_schema.py --write`")


def write_doc():
    text = DOC.read_text()
    if _generated(text) is None:
        sys.exit(f"{DOC} lacks the markers {BEGIN.strip()} and {END.strip()}")
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(head + BEGIN + protocol.schema_markdown() + END + rest.split(END, 1)[1])
    print(f"wrote {DOC}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    write_doc()


def test_every_op_has_a_code_of_its_own():
    assert len(Op.__members__) == len(set(Op)), "two ops share a code (an IntEnum alias)"
