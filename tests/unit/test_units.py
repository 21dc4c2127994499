"""Pure units: protocol, sharding, config, optimizer descriptors (no sockets)."""
import pathlib

import ml_dtypes
import msgpack
import numpy as np
import pytest

import kvps
from kvps.ps import sharding
from kvps.wire import protocol
from kvps.config import VARIABLES, Config
from kvps.errors import ConfigError, ProtocolError, VersionMismatch
from kvps.wire.protocol import DType, Entry, Header, Op


# ---- protocol ----
def test_header_round_trip():
    h = Header(Op.PUSH, 17, "W1", [Entry("fc1.weight", 1, DType.FLOAT16, (3, 4), 24), Entry(5, 0, DType.INT64, (), 8)],
               {"codec": {"type": "topk", "ratio": 0.5}})
    back = protocol.decode(h.encode())
    assert (back.op, back.id, back.src, back.meta) == (Op.PUSH, 17, "W1", {"codec": {"type": "topk", "ratio": 0.5}})
    assert back.keys == [("fc1.weight", 1, DType.FLOAT16, (3, 4), 24), (5, 0, DType.INT64, (), 8)]
    assert repr(back) == "W1 PUSH id=17 keys=2 32B"


def _raw(**changes):
    fields = {"v": protocol.VERSION, "op": 21, "id": 1, "src": "W0", "keys": [], "meta": {}}
    fields.update(changes)
    return msgpack.packb({k: v for k, v in fields.items() if v is not ...})


@pytest.mark.parametrize("frame,message", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb(3), "not a map"),
    (_raw(op=77), "unknown op 77"),
    (_raw(id="x"), "id 'x' is not an int"),
    (_raw(meta=...), "header fields"),
    (_raw(extra=1), "header fields"),
    (_raw(keys=[[1, 0, 0, [2]]]), "is not [key, part, dtype, shape, nbytes]"),
    (_raw(keys=[[1.5, 0, 0, [2], 8]]), "key 1.5 is not an int or str"),
    (_raw(keys=[[1, 0, 42, [2], 8]]), "dtype 42 of key 1 is unknown"),
    (_raw(keys=[[1, 0, 0, [-2], 8]]), "is not a list of sizes"),
])
def test_decode_refuses_bad_headers(frame, message):
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        protocol.decode(frame)


def test_version_mismatch_names_both_versions():
    with pytest.raises(VersionMismatch, match="version 2, this node speaks 1"):
        protocol.decode(_raw(v=2))


def test_unpack_checks_payload_sizes():
    header = Header(Op.PUSH, 1, "W0", [Entry("a", 0, DType.FLOAT32, (2,), 8)]).encode()
    with pytest.raises(ProtocolError, match="declares 1 payload frames, carries 0"):
        protocol.unpack([header])
    with pytest.raises(ProtocolError, match="has 4 bytes, header says 8"):
        protocol.unpack([header, b"1234"])
    lying = Header(Op.PUSH, 1, "W0", [Entry("a", 0, DType.FLOAT32, (3,), 8)]).encode()
    with pytest.raises(ProtocolError, match=r"float32 \(3,\) needs 12"):
        protocol.unpack([lying, b"12345678"])
    h, payloads = protocol.unpack([header, np.arange(2, dtype=np.float32).tobytes()])
    assert protocol.as_array(payloads[0], h.keys[0]).tolist() == [0.0, 1.0]


def test_dtypes():
    assert protocol.dtype_code(ml_dtypes.bfloat16) == DType.BFLOAT16
    assert protocol.numpy_dtype(DType.FLOAT16) == np.float16
    with pytest.raises(ValueError, match="complex64 is not supported"):
        protocol.dtype_code(np.complex64)


# ---- sharding ----
def test_stable_hash_is_fixed():
    # fixed values: every process and run must agree
    import hashlib
    want = int.from_bytes(hashlib.blake2b(b"s:fc1.weight", digest_size=8).digest(), "little")
    assert sharding.stable_hash("fc1.weight") == want
    assert sharding.stable_hash(1) != sharding.stable_hash("1")
    with pytest.raises(TypeError):
        sharding.stable_hash(1.0)


def test_small_arrays_go_whole_to_one_server():
    (part,) = sharding.layout("w", (10, 10), 4, bound=1000)
    assert (part.index, part.start, part.stop) == (0, 0, 100)
    assert part.server == sharding.stable_hash("w") % 4


def test_placement_spreads_keys():
    counts = np.bincount([sharding.layout(k, (4,), 4, 100)[0].server for k in range(400)], minlength=4)
    assert counts.min() > 60


@pytest.mark.parametrize("shape,servers", [((1000, 3), 3), ((7,), 2), ((5, 2), 8), ((1001,), 4), ((2, 600), 4)])
def test_big_arrays_split_into_contiguous_rows(shape, servers):
    parts = sharding.layout("big", shape, servers, bound=5)
    rows = shape[0]
    assert len(parts) == min(servers, rows)
    assert parts[0].row_start == 0 and parts[-1].row_stop == rows
    for a, b in zip(parts, parts[1:]):
        assert a.row_stop == b.row_start
    assert len({p.server for p in parts}) == len(parts)
    assert sum(p.size for p in parts) == int(np.prod(shape))
    assert max(p.row_stop - p.row_start for p in parts) - min(p.row_stop - p.row_start for p in parts) <= 1


def test_big_arrays_are_cut_into_partitions():
    # 16 MB of float32 over 2 servers with 4 MB partitions: 4 parts, two on each server
    parts = sharding.layout("big", (4_000_000,), 2, bound=1_000_000, itemsize=4, partition_bytes=4_000_000)
    assert len(parts) == 4 and [p.size for p in parts] == [1_000_000] * 4
    assert sorted(p.server for p in parts) == [0, 0, 1, 1]
    # whole rounds of the servers, so each holds an equal share: 20 MB over 2 servers -> 6 parts
    parts = sharding.layout("odd", (5_000_000,), 2, bound=1_000_000, itemsize=4, partition_bytes=4_000_000)
    assert len(parts) == 6 and sorted(p.server for p in parts) == [0, 0, 0, 1, 1, 1]
    # never more parts than rows, and no partitions below the bound
    assert len(sharding.layout("r", (3, 2_000_000), 2, 1_000_000, 4, 1 << 20)) == 3
    assert len(sharding.layout("s", (999_999,), 2, 1_000_000, 4, 1)) == 1


def test_split_rows_routes_ids():
    parts = sharding.layout("e", (10, 2), 2, bound=1)
    routed = sharding.split_rows(parts, np.array([1, 7, 9]))
    assert [(p.index, loc.tolist(), pos.tolist()) for p, loc, pos in routed] == [(0, [1], [0]), (1, [2, 4], [1, 2])]


# ---- config ----
def test_config_defaults_and_dmlc_aliases():
    cfg = Config.from_env({})
    assert (cfg.role, cfg.num_workers, cfg.scheduler, cfg.bigarray_bound) == ("worker", 1, None, 250_000)
    cfg = Config.from_env({"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9091",
                           "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "2"})
    assert (cfg.role, cfg.scheduler, cfg.num_workers, cfg.num_servers) == ("server", ("10.0.0.1", 9091), 4, 2)
    cfg = Config.from_env({"KVPS_NUM_WORKERS": "3", "DMLC_NUM_WORKER": "4", "KVPS_SCHEDULER": "h:1"})
    assert cfg.num_workers == 3 and cfg.scheduler == ("h", 1)
    cfg = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"})
    assert (cfg.fusion_bytes, cfg.stall_warning) == (1 << 20, 5.0)


@pytest.mark.parametrize("env,message", [
    ({"KVPS_NUM_WORKERS": "two"}, "KVPS_NUM_WORKERS='two' is not a valid int"),
    ({"KVPS_ROLE": "boss"}, "KVPS_ROLE='boss' is not one of"),
    ({"KVPS_SCHEDULER": "nohost"}, "KVPS_SCHEDULER='nohost' is not HOST:PORT"),
    ({"KVPS_TIMEOUT": "-1"}, "must not be negative"),
    ({"KVPS_HEARTBEAT_TIMEOUT": "0.5"}, "must exceed KVPS_HEARTBEAT_INTERVAL"),
])
def test_config_errors_name_variable_and_value(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Config.from_env(env)


def test_missing_scheduler_names_the_variables():
    with pytest.raises(ConfigError, match="KVPS_SCHEDULER"):
        Config.from_env({}).require_scheduler()


def test_docs_list_every_variable():
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "config.md").read_text()
    for var in VARIABLES:
        assert f"`{var.name}`" in doc, f"docs/config.md does not list {var.name}"


# ---- API surface ----
def test_unknown_kvstore_type_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown kvstore type 'dist_magic'; valid types: local, .*dist_async"):
        kvps.create("dist_magic")


def test_optimizer_descriptors():
    opt = kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=0.5)
    assert opt.spec() == {"name": "sgd", "params": {"learning_rate": 0.1, "wd": 0.0, "rescale_grad": 0.5,
                                                    "clip_gradient": None, "multi_precision": True,
                                                    "momentum": 0.9, "nesterov": False, "lazy_update": True}}
    with pytest.raises(ValueError, match="SGD has no parameter lr"):
        kvps.optimizer.SGD(lr=0.1)
    # MXNet's fit.py passes multi_precision; kvps's servers always keep a float32 master of 16-bit keys
    assert kvps.optimizer.create("nag", multi_precision=False, lazy_update=True).params["multi_precision"] is False
    with pytest.raises(ValueError, match="lazy_update=False"):
        kvps.optimizer.Adam(lazy_update=False)
    assert kvps.optimizer.create("adam").name == "adam"
    assert kvps.optimizer.create("my_rule", alpha=1).spec() == {"name": "my_rule", "params": {"alpha": 1}}


def test_bench_cost_report_pairs_each_run_with_the_plain_run_before_it():
    """kvps bench's feature-cost tables (metrics, CURVE, replicas): runs alternate, so the median of
    run-by-run ratios cancels drift that the ratio of two medians keeps."""
    from kvps.tools.bench.pushpull import cost_report, median_run, paired_interval
    assert paired_interval([1.0, 2.0, 4.0], [1.1, 2.0, 4.8]).median == pytest.approx(1.1)
    assert paired_interval([1.0, 2.0], [1.5, 2.0]).median == pytest.approx(1.25)
    assert paired_interval(None, [1.0]) is None and paired_interval([0.0], [1.0]) is None
    row = {"workload": "round", "bytes": 1024, "mode": "pushpull"}
    plain = median_run([[dict(row, ms=m)] for m in (1.0, 2.0, 4.0)])        # a machine slowing down
    other = median_run([[dict(row, ms=m)] for m in (1.1, 2.0, 4.8)])
    table = cost_report("t", "metrics", plain, other)
    assert "| 1 KB round | pushpull | 2.000 | 2.000 | 1.00 | 1.100 | 1.000 to 1.200 (3 runs) |" in table, table
    # the interval of the paired ratios: a 1.03 target inside it is neither met nor missed
    iv = paired_interval([1.0] * 15, [1.0, 1.1, 0.95, 1.02, 1.05] * 3)
    assert iv.median == pytest.approx(1.02) and iv.low < 1.03 < iv.high and iv.n == 15


def test_copy_into_streams_contiguous_copies_and_falls_back_to_numpy():
    from kvps.arrays import copy_into
    src = np.arange(3 << 18, dtype=np.float32)             # 3 MiB: the streaming kernel's size
    dest = np.empty_like(src)
    copy_into(dest, src)
    assert (dest == src).all()
    grid = np.empty((768, 1024), np.float32)               # the same bytes in another shape (a pull's out)
    copy_into(grid, src)
    assert (grid.reshape(-1) == src).all()
    strided = np.zeros((6, 4), np.float64)[:, ::2]         # not contiguous: numpy's copy, broadcasting
    copy_into(strided, np.arange(2.0))
    assert (strided == [0.0, 1.0]).all()
