"""The checkpoint format: one safetensors file per server, a JSON manifest written last, and the
checks that refuse a checkpoint that is half-written, corrupt or does not fit the job. Pure file
I/O, no sockets (the server and the kvstore call it; docs/checkpoint.md describes the design).

    info = write_shard(directory, "ckpt-3f2a.S0.safetensors", tensors, slots)   # server, atomic
    write_manifest(directory, manifest)                                          # worker 0, last
    manifest = read_manifest(directory)          # CheckpointError naming the file and the fault
    rows = Gather(manifest).rows(key, "value", row_start, row_stop)   # re-sharded on load

Layout of a checkpoint directory:

    manifest.json                      the job's key layout and every file with its size and checksum
    <save id>.S<rank>.safetensors      one per server of the job that saved: its slots' arrays

A shard file is safetensors (8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the tensors back to back), so `safetensors.numpy.load_file` and
other tools read it (bfloat16 as BF16). Its header's __metadata__["kvps"] holds, as a JSON string,
each slot's key, part, optimizer step count and round/clock counters, and the CRC-32 of every tensor.

Integrity: the manifest names every shard with its size and the CRC-32 of its header, and each
header holds the CRC-32 of each of its tensors, whose byte ranges must tile the data exactly. So a
loader that reads only the tensors of the rows it now owns still checks every byte it uses, and
`verify()` checks every byte of the checkpoint; each byte is hashed once when saved. CRC-32 finds
corruption (a truncated or damaged file), not tampering: a checkpoint is trusted input, like a
program. Nothing is ever unpickled.

Atomicity: every file is written under a temporary name, fsynced, renamed, and its directory
fsynced. Shard names carry a fresh save id, so a save never overwrites a file the current manifest
names; the manifest is replaced last, in one rename. Until then the directory still holds the
previous whole checkpoint (or no manifest at all, which load refuses), never a mix.
"""
import contextlib
import json
import os
import re
import time
import zlib

import numpy as np

from kvps.errors import KVValueError

FORMAT = 1
MANIFEST = "manifest.json"
KIND = "kvps-checkpoint"
SHARD = re.compile(r"[A-Za-z0-9_-]{1,64}\.S\d{1,6}\.safetensors")
MAX_HEADER_BYTES = 256 << 20     # a shard's JSON header (about 300 bytes per slot)
MAX_MANIFEST_BYTES = 256 << 20
PIECE = 1 << 20                  # bytes checksummed then written (or read) at a time: in cache

# numpy dtype name <-> safetensors dtype
_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_NP = {v: k for k, v in _ST.items()}


class CheckpointError(KVValueError):
    """A checkpoint is incomplete, corrupt, or does not fit this job; the message names the file."""


def _np_dtype(name, where):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise CheckpointError(f"{where}: unknown dtype {name!r}") from None


def st_dtype(dtype):
    name = np.dtype(dtype).name
    if name not in _ST:
        raise ValueError(f"a checkpoint cannot hold {name} arrays (it holds {', '.join(_ST)})")
    return _ST[name]


def crc(buffer):
    return zlib.crc32(buffer) & 0xFFFFFFFF


def _bytes_of(array):
    array = np.ascontiguousarray(array)
    return memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")


# ---- atomic files ----
def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _atomic(directory, name):
    """A descriptor for directory/name, written atomically: a temporary file, fsync, rename, fsync
    of the directory. A crash (or an exception in the block) leaves at most a *.tmp file behind."""
    final = os.path.join(directory, name)
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        yield fd
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(directory)


def _atomic_write(directory, name, chunks):
    """Write the byte chunks to directory/name atomically (_atomic). Returns the bytes written."""
    total = 0
    with _atomic(directory, name) as fd:
        for chunk in chunks:
            view = memoryview(chunk)
            _write_all(fd, view)
            total += view.nbytes
    return total


# ---- shards (one per server) ----
def generation(changes, records):
    """The state that records (Store.export) hold, in brief: two exports of one store with equal
    generations hold the same state, since every change to a value or to optimizer state steps its
    slot's version or the store's `changes`. A server that finds the generation of the shard it last
    wrote to a place need not write it again (every worker calling kv.save at one step boundary)."""
    return changes, tuple((r["key"], r["part"], r["version"], tuple(r["pushes"]), tuple(r["seen"])) for r in records)


def write_shard(directory, name, tensors, slots):
    """Write one server's shard atomically. `tensors`: [(tensor name, ndarray)]; `slots`: JSON-able
    records (kvps/ps/store.py's export) that name their tensors. Returns the manifest's entry
    {"file", "bytes", "checksum"}.

    One pass over the data: each piece is checksummed just before it is written, while it is in
    cache. The header, which holds those checksums as fixed-width hex, goes in last, at offset 0,
    over a placeholder of the same length."""
    if not SHARD.fullmatch(name):
        raise ValueError(f"shard name {name!r} is not <save id>.S<rank>.safetensors")
    specs, views, offset = {}, [], 0
    for tname, array in tensors:
        view = _bytes_of(array)
        specs[tname] = {"dtype": st_dtype(array.dtype), "shape": list(array.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        views.append((tname, view))

    def header(crcs):
        meta = json.dumps({"format": FORMAT, "slots": slots, "crc32": crcs}, separators=(",", ":"))
        text = json.dumps(dict(specs, __metadata__={"kvps": meta}), separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)      # safetensors pads the header to 8 bytes
        return len(text).to_bytes(8, "little") + text
    crcs = {tname: "00000000" for tname, _ in views}
    placeholder = header(crcs)
    with _atomic(directory, name) as fd:
        _write_all(fd, memoryview(placeholder))
        for tname, view in views:
            running = 0
            for start in range(0, view.nbytes, PIECE):
                piece = view[start:start + PIECE]
                running = zlib.crc32(piece, running)
                _write_all(fd, piece)
            crcs[tname] = f"{running & 0xFFFFFFFF:08x}"
        head = header(crcs)
        assert len(head) == len(placeholder)
        os.pwrite(fd, head, 0)
    return {"file": name, "bytes": len(head) + offset, "checksum": crc(head)}


def _write_all(fd, view):
    while view.nbytes:
        view = view[os.write(fd, view):]


class Shard:
    """One shard file, opened for reading: its header checked against the manifest's entry."""

    def __init__(self, directory, entry):
        self.name = entry["file"]
        self.path = os.path.join(directory, self.name)
        where = self.path
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise CheckpointError(f"{where}: cannot read it ({exc.strerror}); the manifest names it") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"{where} has {size} bytes; the manifest says {entry['bytes']} "
                                  f"(a truncated or replaced file)")
        with open(self.path, "rb") as f:
            first = f.read(8)
            n = int.from_bytes(first, "little") if len(first) == 8 else -1
            if not (0 < n <= min(MAX_HEADER_BYTES, size - 8)):
                raise CheckpointError(f"{where}: header length {n} does not fit the file ({size} bytes)")
            text = f.read(n)
        if crc(first + text) != entry["checksum"]:
            raise CheckpointError(f"{where}: the header's CRC-32 is {crc(first + text):#010x}; the manifest "
                                  f"says {entry['checksum']:#010x} (the file is corrupt)")
        try:
            header = json.loads(text)
            meta = json.loads(header.pop("__metadata__")["kvps"])
            self.crcs, self.slots = meta["crc32"], meta["slots"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: the header is not a kvps shard ({exc})") from None
        self.data_start = 8 + n
        self.tensors = {}
        try:
            end = self._index(header, where)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{where}: the header's tensor table is malformed ({exc})") from None
        if self.data_start + end != size:
            raise CheckpointError(f"{where}: the tensors end at byte {self.data_start + end}, the file at {size}")

    def _index(self, header, where):
        end = 0
        for tname, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, stop = spec["data_offsets"]
            dtype = _np_dtype(_NP.get(spec["dtype"], spec["dtype"]), f"{where} tensor {tname!r}")
            shape = tuple(spec["shape"])
            if begin != end or stop - begin != int(np.prod(shape)) * dtype.itemsize or tname not in self.crcs:
                raise CheckpointError(f"{where}: tensor {tname!r} at bytes {begin}..{stop} does not tile the data "
                                      f"({dtype} {shape}) or has no checksum")
            self.tensors[tname] = (dtype, shape, begin, stop)
            end = stop
        return end

    def read(self, tname):
        """A tensor, its CRC-32 checked (CheckpointError naming the file and tensor)."""
        if tname not in self.tensors:
            raise CheckpointError(f"{self.path} has no tensor {tname!r}")
        dtype, shape, begin, stop = self.tensors[tname]
        out = np.empty(shape, dtype)
        view = _bytes_of(out) if out.size else memoryview(bytearray())
        running = 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + begin)
            got = 0
            while got < view.nbytes:
                n = f.readinto(view[got:got + PIECE])
                if not n:
                    raise CheckpointError(f"{self.path}: tensor {tname!r} ends early (the file was truncated)")
                running = zlib.crc32(view[got:got + n], running)
                got += n
        if f"{running & 0xFFFFFFFF:08x}" != self.crcs[tname]:
            raise CheckpointError(f"{self.path}: tensor {tname!r} fails its CRC-32 check (the file is corrupt)")
        return out


# ---- the manifest (written last, by worker 0) ----
def write_manifest(directory, manifest):
    """Replace directory/manifest.json atomically; from then on the checkpoint is whole."""
    text = json.dumps(dict(manifest, kind=KIND, format=FORMAT, written=time.time()), indent=1).encode()
    _atomic_write(directory, MANIFEST, [text])


def read_manifest(directory):
    """The manifest of a checkpoint directory, its structure checked; CheckpointError naming what
    is missing or wrong (a save that never finished leaves no manifest)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist (or is not a directory)")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {directory} is not a whole checkpoint (a save that did not "
                              f"finish writes no manifest)") from None
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is over {MAX_MANIFEST_BYTES} bytes; it is no kvps manifest")
    try:
        manifest = json.loads(text)
        if manifest.get("kind") != KIND:
            raise ValueError(f"kind is {manifest.get('kind')!r}, not {KIND!r}")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}; this kvps reads format {FORMAT}")
        files = manifest["files"]
        for entry in files:
            if not (SHARD.fullmatch(entry["file"]) and isinstance(entry["bytes"], int)
                    and isinstance(entry["checksum"], int)):
                raise ValueError(f"bad file entry {str(entry)[:200]}")
        for record in manifest["keys"]:
            if not isinstance(record["key"], (int, str)) or not isinstance(record["shape"], list):
                raise ValueError(f"bad key entry {str(record)[:200]}")
            for part, server, start, stop in record["parts"]:
                if not (0 <= server < len(files) and 0 <= start <= stop):
                    raise ValueError(f"key {record['key']!r} part {part} names file {server} rows {start}..{stop}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a kvps checkpoint manifest: {exc}") from None
    manifest["_dir"] = directory
    return manifest


def key_record(manifest, key):
    """The manifest's {"key", "dtype", "shape", "parts"} of a key, or None."""
    index = manifest.get("_index")
    if index is None:
        index = manifest["_index"] = {(type(r["key"]).__name__, r["key"]): r for r in manifest["keys"]}
    return index.get((type(key).__name__, key))


def check_key(manifest, key, dtype, shape):
    """CheckpointError unless the checkpoint holds `key` as this dtype and shape."""
    path = os.path.join(manifest["_dir"], MANIFEST)
    record = key_record(manifest, key)
    if record is None:
        raise CheckpointError(f"{path} holds no key {key!r} (it holds {len(manifest['keys'])} keys); the job "
                              f"initialised it as {np.dtype(dtype)} {tuple(shape)}")
    if record["dtype"] != np.dtype(dtype).name or tuple(record["shape"]) != tuple(shape):
        raise CheckpointError(f"{path} holds key {key!r} as {record['dtype']} {tuple(record['shape'])}; the job "
                              f"initialised it as {np.dtype(dtype)} {tuple(shape)}")
    return record


class Gather:
    """Reads rows of a key's arrays from whichever shards hold them: the parts of the job that
    saved may cut a key's rows differently from the job that loads it (another server count)."""

    def __init__(self, manifest):
        self.manifest = manifest
        self._shards = {}          # file index -> Shard
        self._slots = {}           # (file index, key type, key, part) -> slot record

    def shard(self, index):
        shard = self._shards.get(index)
        if shard is None:
            shard = self._shards[index] = Shard(self.manifest["_dir"], self.manifest["files"][index])
            for record in shard.slots:
                self._slots[(index, type(record["key"]).__name__, record["key"], record["part"])] = record
        return shard

    def slot(self, index, key, part):
        shard = self.shard(index)
        record = self._slots.get((index, type(key).__name__, key, part))
        if record is None:
            raise CheckpointError(f"{shard.path} lacks key {key!r} part {part}, which the manifest places there")
        return shard, record

    def overlapping(self, key, start, stop):
        """[(shard, slot record, old row_start, old row_stop)] of the old parts holding rows [start, stop)."""
        record = key_record(self.manifest, key)
        out = []
        for part, index, old_start, old_stop in record["parts"]:
            if old_start < stop and start < old_stop or (start == stop == old_start == old_stop):
                shard, slot = self.slot(index, key, part)
                out.append((shard, slot, old_start, old_stop))
        return out

    def rows(self, key, tensor, start, stop, scalar=False):
        """Rows [start, stop) of the key's `tensor` ("value", "master", or "state0", "state1", ...),
        None where the saved slots have none (every part of a key steps together, so they agree)."""
        pieces, shape_tail, dtype = [], None, None
        for shard, slot, old_start, old_stop in self.overlapping(key, start, stop):
            tname = slot["tensors"].get(tensor)
            if tname is None:
                return None
            array = shard.read(tname)
            if scalar:
                return array
            lo, hi = max(start, old_start) - old_start, min(stop, old_stop) - old_start
            pieces.append(array[lo:hi])
            shape_tail, dtype = array.shape[1:], array.dtype
        if not pieces:
            raise CheckpointError(f"{os.path.join(self.manifest['_dir'], MANIFEST)}: no saved part of key "
                                  f"{key!r} holds rows {start}..{stop}")
        out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        if out.shape[0] != stop - start:
            raise CheckpointError(f"{os.path.join(self.manifest['_dir'], MANIFEST)}: the saved parts of key "
                                  f"{key!r} cover {out.shape[0]} of rows {start}..{stop}")
        return out.reshape((stop - start,) + tuple(shape_tail)).astype(dtype, copy=False)

    def counters(self, key, start, stop):
        """The slot record (count, version, pushes, seen) of the first old part of these rows."""
        found = self.overlapping(key, start, stop)
        if not found:
            raise CheckpointError(f"{os.path.join(self.manifest['_dir'], MANIFEST)}: no saved part of key "
                                  f"{key!r} holds rows {start}..{stop}")
        return found[0][1]


def verify(directory):
    """Check every byte of a checkpoint (every shard's header and tensors); returns the manifest."""
    manifest = read_manifest(directory)
    for entry in manifest["files"]:
        shard = Shard(directory, entry)
        for tname in shard.tensors:
            shard.read(tname)
    return manifest


def shard_files(directory):
    """The shard files the current manifest names (none when there is no whole checkpoint): a save
    reads them before it starts and deletes them (remove_stale) once its own manifest is in."""
    try:
        return {entry["file"] for entry in read_manifest(directory)["files"]}
    except CheckpointError:
        return set()


def remove_stale(directory, manifest, previous, tmp_age=3600.0):
    """Delete the shards of the previous manifest (`previous`, from shard_files) that `manifest` no
    longer names, and temporary files older than `tmp_age` seconds (a crashed save's). Only those:
    shards of another save still in progress here are never touched."""
    keep = {entry["file"] for entry in manifest["files"]}
    for name in previous - keep:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    now = time.time()
    for name in os.listdir(directory):
        if name.endswith(".tmp") and (name.startswith(MANIFEST) or SHARD.fullmatch(".".join(name.split(".")[:3]))):
            path = os.path.join(directory, name)
            try:
                if now - os.path.getmtime(path) > tmp_age:
                    os.unlink(path)
            except FileNotFoundError:
                pass


# ---- what a server writes and reads ----
def pack(exported):
    """(tensors, slot records) for write_shard from Store.export()'s records: tensor "<i>.value",
    "<i>.master" and "<i>.state<j>" for slot i, with its counters in the record."""
    tensors, slots = [], []
    for i, record in enumerate(exported):
        names = {}

        def add(kind, array):
            names[kind] = f"{i}.{kind}"
            tensors.append((names[kind], array))
        add("value", record["value"])
        count, nstate = None, 0
        if record["opt"] is not None:
            master, count, state = record["opt"]
            if master is not None:
                add("master", master)
            for j, array in enumerate(state):
                if array is not None:
                    add(f"state{j}", array)
            nstate = len(state)
        value = record["value"]
        slots.append({"key": record["key"], "part": record["part"], "dtype": value.dtype.name,
                      "shape": list(value.shape), "tensors": names, "count": count, "nstate": nstate,
                      "version": record["version"], "pushes": [[int(w), c] for w, c in record["pushes"]],
                      "seen": [[int(w), v] for w, v in record["seen"]]})
    return tensors, slots


def slot_state(gather, key, shape, dtype, row_start, what="all"):
    """What a server restores into its (key, part) of this shape that starts at row `row_start`:
    (value or None, optimizer (master, count, state) or None, counters record). `what`: "all", or
    "optimizer" (no value)."""
    shape = tuple(shape)
    scalar = not shape
    stop = row_start + (shape[0] if shape else 1)
    record = gather.counters(key, row_start, stop)
    where = os.path.join(gather.manifest["_dir"], MANIFEST)
    value = None
    if what == "all":
        value = gather.rows(key, "value", row_start, stop, scalar)
        if value.shape != shape or value.dtype != np.dtype(dtype):
            raise CheckpointError(f"{where}: key {key!r} rows {row_start}..{stop} are saved as {value.dtype} "
                                  f"{value.shape}; this server holds {np.dtype(dtype)} {shape}")
    opt = None
    if record["count"] is not None:
        master = gather.rows(key, "master", row_start, stop, scalar)
        state = [gather.rows(key, f"state{j}", row_start, stop, scalar) for j in range(record["nstate"])]
        for array in [master, *state]:
            if array is not None and array.shape != shape:
                raise CheckpointError(f"{where}: key {key!r}'s optimizer state is saved as {array.shape}; "
                                      f"this server holds {shape}")
        opt = (master, record["count"], state)
    return value, opt, record
