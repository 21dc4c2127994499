"""The checkpoint format in process (kvps/ps/checkpoint.py), no sockets: shards round-trip every
dtype and the optimizer state; keys re-shard on load (a server count changed); a store restored
from a checkpoint trains on bit for bit like one that never stopped (Adam, bfloat16 master
weights); and a truncated, corrupt, incomplete or mismatched checkpoint is refused, naming the
file and what is wrong."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

from kvps.ps import checkpoint, sharding
from kvps.ps.checkpoint import CheckpointError
from kvps.ps.rules import Registry
from kvps.ps.store import Store


def _save(directory, stores, keys, num_workers=1, mode="sync", optimizer=None, save_id="t1"):
    """What the servers and worker 0 do on kv.save: a shard per store, then the manifest."""
    files = []
    for rank, store in enumerate(stores):
        tensors, slots = checkpoint.pack(store.export())
        info = checkpoint.write_shard(str(directory), f"{save_id}.S{rank}.safetensors", tensors, slots)
        files.append(dict(info, server=rank))
    manifest = {"step": 3, "mode": mode, "num_workers": num_workers, "num_servers": len(stores),
                "optimizer": optimizer, "dump_optimizer": False, "files": files,
                "keys": [{"key": k, "dtype": np.dtype(d).name, "shape": list(s),
                          "parts": [[p.index, p.server, p.row_start, p.row_stop] for p in parts]}
                         for k, (d, s, parts) in keys.items()]}
    checkpoint.write_manifest(str(directory), manifest)
    return manifest


def _stores(num_servers, keys, rule_spec=None):
    stores = [Store(1, "sync") for _ in range(num_servers)]
    if rule_spec:
        for s in stores:
            s.set_rule(Registry().create(rule_spec))
    return stores


def _init(stores, keys, values):
    for key, (dtype, shape, parts) in keys.items():
        flat = values[key].reshape(-1)
        for p in parts:
            stores[p.server].init(0, key, p.index, dtype, p.shape(shape), flat[p.start:p.stop].copy(), lambda r: None)


def _push(stores, keys, grads):
    for key, (dtype, shape, parts) in keys.items():
        flat = grads[key].reshape(-1)
        for p in parts:
            stores[p.server].push(0, key, p.index, flat[p.start:p.stop].reshape(p.shape(shape)), lambda r: None)


def _value(stores, keys, key):
    dtype, shape, parts = keys[key]
    out = np.empty(shape, dtype).reshape(-1)
    for p in parts:
        got = []
        stores[p.server].pull(0, key, p.index, got.append)
        out[p.start:p.stop] = got[0].reshape(-1)
    return out.reshape(shape)


def _layout(specs, num_servers):
    return {k: (d, s, sharding.layout(k, s, num_servers, 50, np.dtype(d).itemsize)) for k, (d, s) in specs.items()}


def _restore(directory, stores, keys, rule_spec=None):
    """What a server does on LOAD, for every part it holds, then set_optimizer as a script would."""
    manifest = checkpoint.read_manifest(str(directory))
    gather = checkpoint.Gather(manifest)
    saved = (manifest.get("optimizer") or {}).get("name")
    for key, (dtype, shape, parts) in keys.items():
        checkpoint.check_key(manifest, key, dtype, shape)
        for p in parts:
            store = stores[p.server]
            slot = store.check_restore(key, p.index, p.shape(shape), dtype)
            value, opt, counters = checkpoint.slot_state(gather, key, p.shape(shape), dtype, p.row_start)
            store.restore_optimizer({slot.id: opt}, (str(directory), saved))
            store.restore(slot, value, counters, True)
    if rule_spec:
        for s in stores:
            s.set_rule(Registry().create(rule_spec))


SPECS = {"w": (np.float32, (40, 3)), "b": (np.float32, (7,)), 5: (ml_dtypes.bfloat16, (30, 2)),
         "s": (np.float32, ())}
ADAM = {"name": "adam", "params": {"learning_rate": 0.01}}


def _grads(step):
    rng = np.random.default_rng(step)
    return {k: rng.standard_normal(s).astype(d) if s else np.array(rng.standard_normal(), d)
            for k, (d, s) in SPECS.items()}


@pytest.mark.parametrize("before,after", [(1, 1), (2, 3), (3, 1)])
def test_adam_resumes_bit_exact_on_another_server_count(tmp_path, before, after):
    init = {k: (np.arange(int(np.prod(s)) or 1, dtype=np.float32).reshape(s) / 10).astype(d) for k, (d, s) in SPECS.items()}
    # the run that never stops
    keys = _layout(SPECS, 2)
    ref = _stores(2, keys, ADAM)
    _init(ref, keys, init)
    for step in range(6):
        _push(ref, keys, _grads(step))
    # the run that saves after 3 steps with `before` servers, and goes on with `after`
    keys_a = _layout(SPECS, before)
    run = _stores(before, keys_a, ADAM)
    _init(run, keys_a, init)
    for step in range(3):
        _push(run, keys_a, _grads(step))
    _save(tmp_path, run, keys_a, optimizer=ADAM)
    keys_b = _layout(SPECS, after)
    again = _stores(after, keys_b)            # no rule yet: the state waits for set_optimizer
    _init(again, keys_b, {k: np.zeros_like(v) for k, v in init.items()})
    _restore(tmp_path, again, keys_b, ADAM)
    for step in range(3, 6):
        _push(again, keys_b, _grads(step))
    for key in SPECS:
        a, b = _value(ref, keys, key), _value(again, keys_b, key)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
    # the counters came back too: every slot has closed 6 rounds
    assert {s.version for st in again for s in st.slots.values()} == {6}


def test_shard_is_safetensors_and_round_trips(tmp_path):
    keys = _layout(SPECS, 1)
    stores = _stores(1, keys, ADAM)
    _init(stores, keys, {k: np.ones(s, d) for k, (d, s) in SPECS.items()})
    _push(stores, keys, _grads(0))
    manifest = _save(tmp_path, stores, keys, optimizer=ADAM)
    path = tmp_path / manifest["files"][0]["file"]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header["0.value"]["dtype"] in ("F32", "BF16") and "__metadata__" in header
    assert {h["dtype"] for name, h in header.items() if name != "__metadata__"} >= {"F32", "BF16"}
    assert checkpoint.verify(str(tmp_path))["step"] == 3
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def _one_key_checkpoint(tmp_path):
    keys = _layout({"w": (np.float32, (40, 3))}, 1)
    stores = _stores(1, keys)
    _init(stores, keys, {"w": np.ones((40, 3), np.float32)})
    return _save(tmp_path, stores, keys), keys


def _load_all(tmp_path, keys):
    stores = _stores(1, keys)
    _init(stores, keys, {"w": np.zeros((40, 3), np.float32)})
    _restore(tmp_path, stores, keys)


def test_truncated_shard_refused(tmp_path):
    manifest, keys = _one_key_checkpoint(tmp_path)
    path = tmp_path / manifest["files"][0]["file"]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{path.name} has .* bytes; the manifest says"):
        _load_all(tmp_path, keys)


def test_corrupt_tensor_refused(tmp_path):
    manifest, keys = _one_key_checkpoint(tmp_path)
    path = tmp_path / manifest["files"][0]["file"]
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{path.name}: tensor '0.value' fails its CRC-32"):
        _load_all(tmp_path, keys)


def test_corrupt_header_refused(tmp_path):
    manifest, keys = _one_key_checkpoint(tmp_path)
    path = tmp_path / manifest["files"][0]["file"]
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="header's CRC-32"):
        _load_all(tmp_path, keys)


def test_missing_manifest_and_missing_shard_refused(tmp_path):
    manifest, keys = _one_key_checkpoint(tmp_path)
    (tmp_path / manifest["files"][0]["file"]).unlink()
    with pytest.raises(CheckpointError, match="cannot read it"):
        _load_all(tmp_path, keys)
    (tmp_path / checkpoint.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing: .* not a whole checkpoint"):
        checkpoint.read_manifest(str(tmp_path))
    (tmp_path / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="is not a kvps checkpoint manifest"):
        checkpoint.read_manifest(str(tmp_path))


def test_mismatched_key_refused(tmp_path):
    _one_key_checkpoint(tmp_path)
    manifest = checkpoint.read_manifest(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"holds key 'w' as float32 \(40, 3\); the job initialised it as "
                                              r"float16 \(40, 3\)"):
        checkpoint.check_key(manifest, "w", np.float16, (40, 3))
    with pytest.raises(CheckpointError, match=r"as float32 \(40, 3\); the job initialised it as float32 \(41, 3\)"):
        checkpoint.check_key(manifest, "w", np.float32, (41, 3))
    with pytest.raises(CheckpointError, match="holds no key 'v'"):
        checkpoint.check_key(manifest, "v", np.float32, (40, 3))


def test_optimizer_mismatch_refused(tmp_path):
    keys = _layout({"w": (np.float32, (40, 3))}, 1)
    stores = _stores(1, keys, ADAM)
    _init(stores, keys, {"w": np.ones((40, 3), np.float32)})
    _push(stores, keys, {"w": np.ones((40, 3), np.float32)})
    _save(tmp_path, stores, keys, optimizer=ADAM)
    again = _stores(1, keys)
    _init(again, keys, {"w": np.zeros((40, 3), np.float32)})
    with pytest.raises(ValueError, match="holds the state of optimizer 'adam'; this job's optimizer is 'sgd'"):
        _restore(tmp_path, again, keys, {"name": "sgd", "params": {"momentum": 0.9}})


def test_a_new_save_keeps_the_old_checkpoint_until_its_manifest_lands(tmp_path, monkeypatch):
    manifest, keys = _one_key_checkpoint(tmp_path)
    previous = checkpoint.shard_files(str(tmp_path))
    stores = _stores(1, keys)
    _init(stores, keys, {"w": np.full((40, 3), 2, np.float32)})

    def broken(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError):
        _save(tmp_path, stores, keys, save_id="t2")
    monkeypatch.undo()
    # the failed save left no file under a final name, and the old checkpoint is whole
    assert checkpoint.verify(str(tmp_path))["files"] == manifest["files"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("t2")]
    new = _save(tmp_path, stores, keys, save_id="t3")
    checkpoint.remove_stale(str(tmp_path), new, previous)
    assert sorted(os.listdir(tmp_path)) == sorted([checkpoint.MANIFEST, "t3.S0.safetensors"])
    _load_all(tmp_path, keys)


def test_pushes_of_an_open_round_are_not_saved(tmp_path):
    """A checkpoint taken while some workers have pushed into the next round (a periodic one) saves
    the clocks of the value: those pushes come again after the resume, and the rounds close."""
    store = Store(2, "sync")
    store.init(0, "w", 0, np.float32, (4,), np.zeros(4, np.float32), lambda r: None)
    for w in (0, 1):
        store.push(w, "w", 0, np.ones(4, np.float32), lambda r: None)
    store.push(1, "w", 0, np.ones(4, np.float32), lambda r: None)      # W1 is one round ahead
    (record,) = store.export()
    assert record["version"] == 1 and record["pushes"] == [(0, 1), (1, 1)]


def test_generation_changes_with_the_state_and_only_with_it():
    """Every worker of a dist_sync job saving at one step boundary gets one write per server: the
    generation stays while pushes only wait in the next round, and moves with a closed round, a
    restore and a new optimizer."""
    store = Store(2, "sync")
    store.init(0, "w", 0, np.float32, (4,), np.zeros(4, np.float32), lambda r: None)

    def generation():
        return checkpoint.generation(store.changes, store.export(copy=False))
    for w in (0, 1):
        store.push(w, "w", 0, np.ones(4, np.float32), lambda r: None)
    first = generation()
    store.push(0, "w", 0, np.ones(4, np.float32), lambda r: None)      # W0 saved and pushes on
    assert generation() == first
    store.push(1, "w", 0, np.ones(4, np.float32), lambda r: None)      # the round closes
    after = generation()
    assert after != first
    store.restore(store.slots[("w", 0)], np.full(4, 7.0, np.float32))   # a load: same counters
    assert generation() != after
    restored = generation()
    store.set_rule(Registry().create({"name": "sgd", "learning_rate": 0.1, "momentum": 0.9}))
    assert generation() != restored


def test_shards_read_by_the_safetensors_library(tmp_path):
    """Where safetensors is installed (it is no dependency of kvps), it reads a shard as written."""
    st = pytest.importorskip("safetensors.numpy")
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    checkpoint.write_shard(str(tmp_path), "a.S0.safetensors", [("0.value", value), ("0.state0", value * 2)], [])
    got = st.load_file(str(tmp_path / "a.S0.safetensors"))
    assert got["0.value"].tobytes() == value.tobytes() and got["0.state0"].tobytes() == (value * 2).tobytes()
