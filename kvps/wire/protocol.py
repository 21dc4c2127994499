"""The kvps wire protocol: version, op codes, dtypes, the message header and each op's meta schema.

A message is a ZeroMQ multipart message:

    frame 0      header: a msgpack map (below), small
    frame 1..n   raw array payloads, one per entry whose nbytes > 0, in entry order

A ROUTER socket prepends the sender's routing id; the transport strips it.

Header fields (all required; unknown fields are refused):

    v      int    protocol version (VERSION); another version is refused
    op     int    an Op value
    id     int    request id chosen by the sender; a reply carries its request's id
    src    str    sender's node name: "H" (scheduler), "S<rank>", "W<rank>", or "?" before registration
    keys   list   entries [key, part, dtype, shape, nbytes]: key is int or str, part is the
                  part index of a split array (0 for whole arrays), dtype a DType value,
                  shape a list of ints, nbytes the size of this entry's payload frame (0: none)
    meta   map    op-specific fields, declared per op in SCHEMA: who sends the op, what it means,
                  and each field's name, type, whether it is required, and meaning

`decode` checks every field, meta included, by exact type, so a value nested where a scalar
belongs (or deeper than its declared type) is refused at the first level it does not fit, and
error texts quote a bounded extract of what came in. Decoding is bounded before it starts: a
header over MAX_HEADER_BYTES is refused unread, and msgpack itself refuses any list longer than
MAX_ENTRIES (so a header's entries, and every list in its meta) and any string over 1 MiB.
Payloads never go inside msgpack, and nothing received is ever unpickled. docs/wire.md holds SCHEMA as tables (`schema_markdown()`);
`python tests/unit/test_wire_schema.py --write` regenerates them.
"""
import dataclasses
import enum
import operator
import reprlib

import msgpack
import numpy as np

from kvps.dtypes import BY_CODE, DType, dtype_code, numpy_dtype  # noqa: F401 (the wire's dtypes)
from kvps.errors import ProtocolError, VersionMismatch

VERSION = 1

# What a peer can make a decoder hold, checked before the work it would cause. The biggest header
# kvps sends (MAX_ENTRIES entries with long str keys) is a few MB and decodes in about 0.1 s; the
# worst one within these limits takes about 0.3 s (65,536 entries of 64 dimensions).
MAX_HEADER_BYTES = 8 << 20
MAX_ENTRIES = 1 << 16           # entries per message, and items in any list of a header
MAX_NDIM = 64                   # numpy's own limit on dimensions
MAX_ROW_IDS = 1 << 24           # row ids in one ROW_SPARSE_PULL or ROW_SPARSE_PUSH (unique, per (key, part))


CLOSED = "it closed its kvstore"      # NODE_LEFT's reason when a node left without an error


class Op(enum.IntEnum):
    """What a message is; SCHEMA says who sends it and what its meta holds."""
    # control: nodes <-> scheduler, and the replies
    REGISTER = 1
    MEMBERSHIP = 2
    BARRIER = 3
    HEARTBEAT = 4
    FINALIZE = 5
    SHUTDOWN = 6
    NODE_FAILED = 7
    ACK = 8
    ERROR = 9
    NODE_LEFT = 10
    WORKERS = 11
    SERVERS = 12
    # data: worker -> server
    INIT = 20
    PUSH = 21
    PULL = 22
    PUSHPULL = 23
    ROW_SPARSE_PULL = 24
    SET_OPTIMIZER = 25
    VALUE = 26
    STATS = 27
    JOIN = 28
    ROW_SPARSE_PUSH = 29
    SAVE = 30
    LOAD = 31
    ATTACH = 35
    # data: server -> server (chain replication)
    STATE = 36
    ROUND = 37
    BUNDLE = 38
    # data: worker -> worker
    RING = 40


# ---- meta types: msgpack-level, checked by exact Python type (a bool is not an int) ----
@dataclasses.dataclass(frozen=True, slots=True)
class Scalar:
    name: str
    types: tuple

    def accepts(self, value):
        return type(value) in self.types

    def __str__(self):
        return self.name


INT = Scalar("int", (int,))
FLOAT = Scalar("float", (float,))
STR = Scalar("str", (str,))
BOOL = Scalar("bool", (bool,))
BYTES = Scalar("bytes", (bytes,))
SCALAR = Scalar("scalar", (type(None), bool, int, float, str))     # nil, bool, int, float or str


@dataclasses.dataclass(frozen=True, slots=True)
class ListOf:
    item: object

    def accepts(self, value):
        if type(value) is not list:
            return False
        ok = self.item.accepts
        return all(ok(item) for item in value)

    def __str__(self):
        return f"list of {self.item}"


@dataclasses.dataclass(frozen=True, slots=True)
class MapOf:
    """A map with str keys and values of one type."""
    value: object

    def accepts(self, value):
        if type(value) is not dict:
            return False
        ok = self.value.accepts
        return all(type(key) is str and ok(item) for key, item in value.items())

    def __str__(self):
        return f"map of str -> {self.value}"


@dataclasses.dataclass(frozen=True, slots=True)
class OneOf:
    """A value of any of the given types."""
    kinds: tuple

    def accepts(self, value):
        return any(kind.accepts(value) for kind in self.kinds)

    def __str__(self):
        return " or ".join(map(str, self.kinds))


@dataclasses.dataclass(frozen=True, slots=True)
class Tuple:
    """A list of fixed length whose items have the given types, e.g. [host, port, pid]."""
    items: tuple

    def accepts(self, value):
        return (type(value) is list and len(value) == len(self.items)
                and all(kind.accepts(item) for kind, item in zip(self.items, value)))

    def __str__(self):
        return "[" + ", ".join(map(str, self.items)) + "]"


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A map with named fields (a schema inside a field); unknown fields are refused."""
    fields: dict        # name -> Field

    def accepts(self, value):
        if type(value) is not dict:
            return False
        fields = self.fields
        for name, item in value.items():
            field = fields.get(name)
            if field is None or not field.type.accepts(item):
                return False
        for name, field in fields.items():
            if field.required and name not in value:
                return False
        return True

    def __str__(self):
        return "map {" + ", ".join(f"{name}{'' if field.required else '?'}: {field.type}"
                                   for name, field in self.fields.items()) + "}"


@dataclasses.dataclass(frozen=True)
class Field:
    type: object        # one of the types above
    meaning: str
    required: bool = True


@dataclasses.dataclass(frozen=True)
class Message:
    route: str          # who sends it to whom
    meaning: str
    meta: dict = dataclasses.field(default_factory=dict)     # field name -> Field


# ---- the schema: one per op ----
_ADDRESSES = ListOf(Tuple((STR, INT, INT)))
_CODEC_RECORD = Record({"type": Field(STR, "2bit, 1bit, fp16, bf16 or topk (kvps.ps.compression)"),
                         "threshold": Field(FLOAT, "2bit and 1bit: the quantisation threshold", required=False),
                         "ratio": Field(FLOAT, "topk: the share of the elements sent", required=False)})
_SCHEDULE = Field(Record({"name": Field(STR, "factor, multifactor, poly or cosine (kvps/lr_scheduler.py)"),
                          "params": Field(MapOf(OneOf((SCALAR, ListOf(INT)))), "the schedule's numbers")}),
                  "the learning rate's schedule (absent: learning_rate throughout)", required=False)
_CODEC = Field(_CODEC_RECORD, "the compression every float32 entry's payload is in (absent: none)", required=False)
_PULL = Field(_CODEC_RECORD, "compress the reply's float32 values with this codec, with the server's error "
                             "feedback for this worker (absent: send them as they are)", required=False)

# Shared memory (kvps/wire/shm.py): an entry whose payload (or reply) is in a segment the worker
# attached travels with nbytes 0 and is named here by its index in the header's entries.
_SHM_IN = Field(ListOf(Tuple((INT, INT, INT))), "[entry, segment, offset]: entries whose payloads are in "
                                                "shared memory, not in a frame", required=False)
_SHM_INTO = Field(ListOf(Tuple((INT, INT, INT))), "[entry, segment, offset]: where to write the entries' "
                                                  "values in shared memory instead of sending them", required=False)
_MAPPED = Field(INT, "how many of the server's value segments this worker has mapped read-only (absent: none, "
                     "and none may be offered): the reply may name values in segments 0 .. mapped - 1 "
                     "instead of writing them into `into`", required=False)

_DONE = Field(ListOf(INT), "the numbers (VALUE meta read) of replies whose values this worker has copied out of "
                          "the server's value segments since its last request: the server may change them now "
                          "(server/reads.py)", required=False)

# Chain replication (KVPS_REPLICAS; server/replication.py): which key range a data request is for,
# and whether it is a copy an upstream server of that range's chain forwarded.
_HOME = Field(INT, "the home rank of the entries' key range (KVPS_REPLICAS: it picks the chain)", required=False)
_CHAIN = Field(BOOL, "a copy forwarded along the range's chain by the server before this one, which gets "
                     "the reply (a PUSHPULL copy is applied as its push and answered with ACK)", required=False)
_DEFERRED = Field(BOOL, "a copy without values (one replica, sync): its entries hold their places in their "
                         "rounds, whose sums come in ROUND messages", required=False)
_REPLICATED = {"home": _HOME, "chain": _CHAIN}

SCHEMA = {
    Op.REGISTER: Message("node -> H", "join the job; answered with MEMBERSHIP once every node has registered", {
        "role": Field(STR, "server or worker"),
        "host": Field(STR, "the address peers reach this node at"),
        "port": Field(INT, "the port of this node's ROUTER (0: it binds none)"),
        "pid": Field(INT, "the node's process id (named in messages)"),
        "rank": Field(INT, "the rank it asks for (-1 or absent: any)", required=False),
        "recover": Field(BOOL, "the node is in a running job and registers again with a recovered scheduler, "
                               "keeping its rank", required=False),
        "left": Field(ListOf(STR), "with recover: the workers the node knows have left the job", required=False),
        "mode": Field(STR, "workers: the kvstore's consistency as a wire string (sync, sync:backup=1, async, "
                           "ssp:4, allreduce); the workers of a job must agree", required=False),
        "metrics_port": Field(INT, "the port of the node's Prometheus /metrics (KVPS_METRICS_PORT; absent: none), "
                                   "listed in the scheduler's /targets", required=False),
    }),
    Op.MEMBERSHIP: Message("H -> node", "reply to REGISTER: the job's table", {
        "rank": Field(INT, "the rank the receiver got"),
        "servers": Field(_ADDRESSES, "[host, port, pid] of every server, by rank"),
        "workers": Field(_ADDRESSES, "[host, port, pid] of every worker, by rank"),
        "mode": Field(STR, "the workers' mode, as they registered it"),
        "incarnation": Field(INT, "the scheduler's random id (see ACK)", required=False),
        "late": Field(BOOL, "the receiver joined a running job (KVPS_ELASTIC): its init sets no value, "
                            "it reads the current ones", required=False),
        "dead": Field(ListOf(INT), "KVPS_REPLICAS: the dead servers (a server that joined late)", required=False),
        "joined": Field(ListOf(INT), "KVPS_REPLICAS: the servers that took a dead one's rank, in the order they "
                                     "joined (kvps/wire/chains.py)", required=False),
    }),
    Op.BARRIER: Message("node -> H", "wait for a group; answered with ACK once every live member has arrived", {
        "group": Field(STR, "workers, servers or all"),
    }),
    Op.HEARTBEAT: Message("node -> H", "still alive; answered with ACK, which is the scheduler's heartbeat", {
        "sent": Field(FLOAT, "the node's clock as it sent this (Unix seconds; with KVPS_METRICS_PORT or "
                             "KVPS_TIMELINE), echoed in the ACK for its clock-offset estimate", required=False),
    }),
    Op.FINALIZE: Message("worker -> H", "this worker is done; answered with ACK, the others get NODE_LEFT", {
        "reason": Field(STR, "why, when its script raised: \"its script failed: RuntimeError: ...\"", required=False),
    }),
    Op.SHUTDOWN: Message("H -> server", "every worker has finished or died: exit now", {
        "failed": Field(STR, "the job failed, and why: the server exits non-zero", required=False),
    }),
    Op.NODE_FAILED: Message("H -> all", "a node died: every call that waits on it fails with NodeFailure", {
        "node": Field(STR, "the dead node's name (H, S1, W0, ...)"),
        "reason": Field(STR, "why it is deemed dead"),
    }),
    Op.ACK: Message("reply", "done", {
        "last": Field(STR, "barrier replies: the node that arrived last", required=False),
        "incarnation": Field(INT, "heartbeat replies: this scheduler's random id; a new one means a scheduler "
                                  "started with --recover took over, and the node registers again", required=False),
        "time": Field(FLOAT, "heartbeat replies: the scheduler's clock (Unix seconds), from which nodes "
                             "estimate their clock offset for the timeline", required=False),
        "sent": Field(FLOAT, "heartbeat replies: the HEARTBEAT's own sent, echoed (pairs the reply with its "
                             "heartbeat)", required=False),
        "file": Field(STR, "SAVE replies: the shard file written (kvps/ps/checkpoint.py)", required=False),
        "bytes": Field(INT, "SAVE replies: its size", required=False),
        "checksum": Field(INT, "SAVE replies: the CRC-32 of its header, which holds each tensor's CRC-32",
                          required=False),
        "for": Field(STR, "chain replication: replies to a copy name the worker whose request it is; replies "
                          "to a ROUND name its sender", required=False),
        "inline": Field(BOOL, "ROUND replies: its sums in the sender's memory could not be read; send them, and "
                              "every later one, inline", required=False),
        "released": Field(ListOf(INT), "ROUND replies: ids of ROUNDs whose sums in the sender's memory the "
                                       "replier no longer reads (the sender may write that memory again)",
                          required=False),
    }),
    Op.ERROR: Message("reply", "the request failed; the receiver raises the kind's exception with the message", {
        "kind": Field(STR, "value, key, protocol, node or error (kvps.errors.REMOTE_KINDS)"),
        "message": Field(STR, "what was wrong, naming the bad value"),
        "for": Field(STR, "chain replication: replies to a copy name the worker whose request it is; to a "
                          "ROUND, its sender", required=False),
    }),
    Op.NODE_LEFT: Message("H -> all", "a worker left on purpose (FINALIZE); not a failure", {
        "node": Field(STR, "the name of the worker that left"),
        "reason": Field(STR, f"what it did: \"{CLOSED}\", or FINALIZE's reason"),
    }),
    Op.WORKERS: Message("H -> all", "elastic jobs (KVPS_ELASTIC): a worker was removed or joined", {
        "workers": Field(_ADDRESSES, "[host, port, pid] of every worker rank; a vacant rank is [\"\", 0, -1]"),
        "node": Field(STR, "the worker that was removed or joined"),
        "change": Field(STR, "removed or joined"),
        "reason": Field(STR, "why"),
    }),
    Op.SERVERS: Message("H -> all", "chain replication (KVPS_REPLICAS): a server died and the next live server "
                                    "of each chain it was in takes its place (kvps/wire/chains.py)", {
        "dead": Field(ListOf(INT), "the ranks of every dead server so far"),
        "node": Field(STR, "the server that died, or joined"),
        "reason": Field(STR, "why it is deemed dead, or who took its rank"),
        "joined": Field(ListOf(INT), "the servers that took a dead one's rank, in the order they joined; each "
                                     "is the tail of its chains once the old tail has sent it the state (STATE)",
                        required=False),
        "servers": Field(_ADDRESSES, "[host, port, pid] of every server, by rank (when one joined)", required=False),
    }),
    Op.INIT: Message("worker -> server", "declare keys: rank 0's entries carry the initial values, the other "
                                         "ranks' the shapes only; answered with ACK", dict(_REPLICATED)),
    Op.PUSH: Message("worker -> server", "add the entries' payloads into their keys; answered with ACK",
                     {"codec": _CODEC, "shm": _SHM_IN, "done": _DONE, "deferred": _DEFERRED, **_REPLICATED}),
    Op.PULL: Message("worker -> server", "read keys (entries without payloads); answered with VALUE",
                     {"into": _SHM_INTO, "mapped": _MAPPED, "done": _DONE, "pull": _PULL, "home": _HOME}),
    Op.PUSHPULL: Message("worker -> server", "PUSH, then PULL of the same entries; answered with VALUE",
                         {"codec": _CODEC, "shm": _SHM_IN, "into": _SHM_INTO, "mapped": _MAPPED, "done": _DONE,
                          "pull": _PULL, "deferred": _DEFERRED, **_REPLICATED}),
    Op.ROW_SPARSE_PULL: Message("worker -> server", "read some rows: each entry's payload holds int64 row ids "
                                                    "local to its part; answered with VALUE", {"home": _HOME}),
    Op.SET_OPTIMIZER: Message("worker -> server", "apply this update rule to pushes from now on; answered with ACK", {
        "generation": Field(INT, "how many optimizers the worker has set; servers keep the newest"),
        "spec": Field(Record({"name": Field(STR, "the rule's name in the server's registry"),
                              "params": Field(MapOf(SCALAR), "the rule's parameters"),
                              "lr_scheduler": _SCHEDULE}),
                      "the optimizer (kvps.optimizer; no code travels)"),
    }),
    Op.VALUE: Message("server -> worker", "reply carrying the values asked for, a payload per non-empty entry", {
        "shm": Field(ListOf(INT), "the entries (by index) whose values were written into the regions the "
                                  "request named in `into` instead of travelling as payloads", required=False),
        "at": Field(ListOf(Tuple((INT, INT, INT))), "[entry, segment, offset]: the entries whose values the worker "
                                                    "copies straight out of the server's value segment (one it "
                                                    "said it has mapped)", required=False),
        "read": Field(INT, "with `at`: this reply's number among those naming values in the server's segments to "
                           "this worker (1, 2, ...); the values stay as they are until a later request of the "
                           "worker lists it in `done`", required=False),
        "segments": Field(ListOf(Tuple((INT, INT, BYTES))), "[segment, fd, nonce]: the server's value segments "
                                                           "from the request's `mapped` on, for the worker to map "
                                                           "read-only (through /proc/<pid>/fd/<fd>, checking the "
                                                           "nonce at its start)", required=False),
        "codec": Field(_CODEC_RECORD, "compressed pull: the codec of the float32 keys' entries whose dtype is not "
                                      "float32 (a float32 entry travels as it is)", required=False),
        "delta": Field(BOOL, "compressed pull: the entries are changes to add to the worker's copy (weights); "
                             "false: the values themselves (a sync round's merged update)", required=False),
        "held": Field(BOOL, "chain replication: a PUSHPULL's values, sent before its push is applied at every "
                            "replica; the request is answered by the ACK that follows, same id", required=False),
    }),
    Op.ATTACH: Message("worker -> server", "map a shared-memory segment of this co-located worker "
                                           "(kvps/wire/shm.py); answered with ACK, or ERROR: use TCP", {
        "pid": Field(INT, "the worker's process id, as it registered"),
        "fd": Field(INT, "the memfd's descriptor in that process (opened through /proc/<pid>/fd/<fd>)"),
        "segment": Field(INT, "the segment's number, named by later requests"),
        "nonce": Field(BYTES, "the 16 bytes the worker wrote at the segment's start"),
    }),
    Op.STATE: Message("server -> server", "chain replication: the old tail of a chain sends the server that "
                                          "joined its tail the state of the chain's ranges, then forwards to it "
                                          "(server/replication.py); an entry per array, in the order of `slots`", {
        "home": Field(INT, "the home rank whose ranges these are"),
        "optimizer": Field(Record({"generation": Field(INT, "as SET_OPTIMIZER's"),
                                   "name": Field(STR, "the rule's name in the server's registry"),
                                   "params": Field(MapOf(SCALAR), "the rule's parameters"),
                                   "lr_scheduler": _SCHEDULE}),
                           "the update rule the sender runs", required=False),
        "slots": Field(ListOf(Record({
            "version": Field(INT, "updates applied"),
            "pushes": Field(ListOf(Tuple((INT, INT))), "[worker, clock] (kvps/ps/clocks.py), less the pushes below"),
            "seen": Field(ListOf(Tuple((INT, INT))), "[worker, version its last pull received]"),
            "count": Field(INT, "the update rule's step count (absent: no rule state)", required=False),
            "arrays": Field(ListOf(STR), "what each of this slot's entries after its value is: master, state<j> or "
                                         "none (a state array the rule does not keep), push <worker> (a push "
                                         "waiting in the open round), rows (the row ids of the push before); "
                                         "defer <worker> (a push whose values the round's ROUND brings) has "
                                         "no entry"),
        })), "per slot, its counters and how many entries follow its value entry"),
        "window": Field(ListOf(Tuple((STR, INT, ListOf(INT), ListOf(INT)))),
                        "[worker, highest id forgotten, ids answered, ids answered with values] of the range's "
                        "requests (kvps/wire/window.py): asked again, they are not applied twice"),
    }),
    Op.BUNDLE: Message("server -> server", "several messages to one peer in one (chain replication: a "
                                           "server's copies, ROUNDs and their answers of one I/O turn); its "
                                           "frames are theirs, one after the other, each handled as if it "
                                           "came alone", {
        "counts": Field(ListOf(INT), "the number of frames of each message (its header and payloads), in order"),
    }),
    Op.ROUND: Message("server -> server", "chain replication with one replica, sync: the sums of rounds the "
                                          "sender closed in one turn of its I/O thread, an entry each, for the "
                                          "rounds that the deferred copies of their pushes opened at the receiver "
                                          "(server/replication.py); answered once applied (the deferred copies "
                                          "get no answer of their own)", {
        "home": Field(INT, "the home rank of the entries' key ranges"),
        "rounds": Field(ListOf(INT), "per entry, the key's version once its round is applied (its rounds "
                                     "closed so far)"),
        "at": Field(ListOf(Tuple((INT, INT, INT))), "[entry index, segment, offset]: those sums lie in the "
                                                    "sender's value segments (the receiver is on its host), not "
                                                    "in payloads; the receiver reads them there, and the sender "
                                                    "writes that memory again once an answer names this ROUND in "
                                                    "`released`", required=False),
        "segments": Field(ListOf(Tuple((INT, INT, BYTES))), "[segment, fd, nonce]: value segments of the sender "
                                                           "offered for the first time, to map read-only as a "
                                                           "worker maps VALUE's", required=False),
    }),
    Op.STATS: Message("worker -> server", "ask for the server's counters; the reply (STATS too) has these fields", {
        "pushes": Field(INT, "entries pushed", required=False),
        "pulls": Field(INT, "entries pulled", required=False),
        "rounds": Field(INT, "sync rounds closed", required=False),
        "pooled": Field(INT, "sync rounds merged on the server's pool of threads (KVPS_SERVER_THREADS)",
                        required=False),
        "updates": Field(INT, "optimizer updates applied", required=False),
        "decoded": Field(INT, "compressed entries decoded", required=False),
        "bytes_in": Field(INT, "payload bytes pushed", required=False),
        "bytes_out": Field(INT, "payload bytes sent in replies", required=False),
        "joins": Field(INT, "JOINs received", required=False),
        "last_joined": Field(INT, "the rank that joined last when every worker had joined (-1: not yet)",
                             required=False),
        "dropped": Field(INT, "stale pushes dropped (sync with backup workers)", required=False),
        "ssp_waits": Field(INT, "ssp pulls that waited for a slower worker", required=False),
        "staleness": Field(ListOf(INT), "histogram: index i counts the pushes applied i updates after their "
                                        "worker last pulled the key", required=False),
        "kernels": Field(MapOf(INT), "calls per kernel operation on the active backend", required=False),
        "backend": Field(STR, "the kernel backend (c, numba or numpy)", required=False),
        "keys": Field(INT, "the (key, part) slots the server holds", required=False),
        "mode": Field(STR, "the consistency mode as a wire string", required=False),
        "duplicates": Field(INT, "requests received again (resent or duplicated) and answered once",
                            required=False),
        "shared": Field(INT, "entries whose payload or value went through shared memory (kvps/wire/shm.py)",
                        required=False),
        "placed": Field(INT, "reply entries that co-located workers copied straight out of the server's value "
                             "segments (kvps/wire/shm.py)", required=False),
        "moved": Field(INT, "values changed in other memory because a reply still read them (server/reads.py)",
                       required=False),
        "forwarded": Field(INT, "requests forwarded to the next server of a key range's chain (KVPS_REPLICAS)",
                           required=False),
        "round_sums": Field(INT, "round sums sent to the next server of a chain (ROUND; one replica, sync)",
                            required=False),
        "round_sums_shared": Field(INT, "of which the next server read in this server's memory", required=False),
        "local_clients": Field(INT, "lanes of workers on this host that connected through its local socket",
                               required=False),
    }),
    Op.JOIN: Message("worker -> server", "this worker has no more data: count it as pushing zeros; answered with ACK"),
    Op.ROW_SPARSE_PUSH: Message("worker -> server", "entries in pairs per (key, part): int64 row ids local to the "
                                                    "part, then those rows; answered with ACK", dict(_REPLICATED)),
    Op.SAVE: Message("worker -> server", "checkpoint: copy every key's value, optimizer state and counters now, "
                                         "then write them as one shard file on a background thread; answered with "
                                         "ACK (file, bytes, checksum) once the file is durable, or at once with the "
                                         "shard last written to the same path when nothing changed since "
                                         "(docs/checkpoint.md)", {
        "path": Field(STR, "the checkpoint directory (the same file system for every node)"),
        "save": Field(STR, "this save's id: the shard is <save>.S<rank>.safetensors"),
        "hold": Field(BOOL, "no update can come before this save is written (kv.save): write the live state, "
                            "holding back "
                            "requests that would change it until written, instead of copying it first",
                      required=False),
        "home": Field(INT, "KVPS_REPLICAS: save the ranges of this home rank (the shard is named after it)",
                      required=False),
        "taken": Field(BOOL, "a fence sent after SAVE `save` on the same connection: answered (ACK) once that "
                             "save has copied the state, before its file is written (periodic checkpoints)",
                       required=False),
    }),
    Op.LOAD: Message("W0 -> server", "restore the entries' (key, part)s from checkpoint `path`, whatever server "
                                     "count saved it (the server reads the rows it now holds); answered with ACK", {
        "path": Field(STR, "the checkpoint directory"),
        "rows": Field(ListOf(INT), "per entry: the first row of its part within its key"),
        "what": Field(STR, "all (values, optimizer state, counters) or optimizer (state and step counts only)"),
        **_REPLICATED,
    }),
    Op.RING: Message("worker -> worker", "one chunk of a ring all-reduce step, sent to the right neighbour; "
                                         "between neighbours on one host also the shared-memory handshake "
                                         "(kvps/collective/shared.py), elsewhere the TCP link's "
                                         "(kvps/collective/link.py)", {
        "seq": Field(INT, "the collective's number (every worker runs them in the same order)", required=False),
        "n": Field(INT, "the collective's buffer size in elements", required=False),
        "phase": Field(STR, "rs (reduce-scatter) or ag (all-gather); attach (map my segment), attached (the "
                            "answer, to the left neighbour), done (the left neighbour's placed chunks of "
                            "collective seq are read); link (my TCP link's offer, to the right neighbour, or "
                            "its refusal, to the left); start (collective seq of n elements has begun, its "
                            "chunks on the link)"),
        "step": Field(INT, "the step within the phase", required=False),
        "chunk": Field(INT, "the chunk's index within its segment", required=False),
        "epoch": Field(INT, "joins the sender has completed (a collective of a later epoch waits)", required=False),
        "at": Field(Tuple((INT, INT)), "[segment, offset]: the chunk is in the sender's shared segment, not in "
                                       "the message", required=False),
        "segment": Field(INT, "attach, attached: the sender's segment id", required=False),
        "fd": Field(INT, "attach: the segment's descriptor in the sender (opened through /proc)", required=False),
        "nonce": Field(BYTES, "attach: the bytes the segment starts with; link: the bytes a connection to the "
                              "offered port must send first", required=False),
        "refused": Field(STR, "attached: why the segment could not be mapped (it stays on TCP); link: why the "
                              "right neighbour cannot take the link (chunks stay on ZeroMQ)", required=False),
        "port": Field(INT, "link: the sender's listening port, on the host the job registered for it",
                      required=False),
        "from": Field(INT, "link: the first collective whose chunks go on the link", required=False),
    }),
}

# per op: ({field name: its type's accepts}, required names); a KeyError here: an Op without a schema
_META = {op: ({name: field.type.accepts for name, field in SCHEMA[op].meta.items()},
              tuple(name for name, field in SCHEMA[op].meta.items() if field.required)) for op in Op}


def schema_markdown():
    """SCHEMA as markdown: the dtype codes, a table of the ops, then each op's meta fields
    (docs/wire.md holds it)."""
    lines = ["dtype codes: " + ", ".join(f"{int(d)} {BY_CODE[d]}" for d in DType) + ".", "",
             "| op | code | from -> to | meaning |", "|---|---|---|---|"]
    lines += [f"| [`{op.name}`](#{op.name.lower()}) | {int(op)} | {SCHEMA[op].route} | {SCHEMA[op].meaning} |"
              for op in Op]
    for op in Op:
        message = SCHEMA[op]
        lines += ["", f"### {op.name}", "", f"{message.route}, code {int(op)}: {message.meaning}.", ""]
        if not message.meta:
            lines.append("meta: empty.")
            continue
        lines += ["| field | type | required | meaning |", "|---|---|---|---|"]
        for name, field in _flat(message.meta):
            kind = "map" if isinstance(field.type, Record) else field.type
            lines.append(f"| `{name}` | {kind} | {'yes' if field.required else 'no'} | {field.meaning} |")
    return "\n".join(lines) + "\n"


def _flat(fields, prefix=""):
    for name, field in fields.items():
        yield prefix + name, field
        if isinstance(field.type, Record):
            yield from _flat(field.type.fields, f"{prefix}{name}.")


# ---- header ----
class Entry(tuple):
    """One key (or part of a split key) in a message: (key, part, dtype, shape, nbytes)."""
    __slots__ = ()

    def __new__(cls, key, part, dtype, shape, nbytes):
        return tuple.__new__(cls, (key, part, dtype, tuple(shape), nbytes))

    # itemgetter, not a lambda: read on every request, and a C call costs no Python frame
    key = property(operator.itemgetter(0))
    part = property(operator.itemgetter(1))
    dtype = property(operator.itemgetter(2))
    shape = property(operator.itemgetter(3))
    nbytes = property(operator.itemgetter(4))

    @classmethod
    def of(cls, key, part, array):
        """An entry describing a payload array."""
        return cls(key, part, dtype_code(array.dtype), array.shape, array.nbytes)

    @classmethod
    def bare(cls, key, part, dtype, shape):
        """An entry without payload (a pull request, or a non-root init)."""
        return cls(key, part, dtype, shape, 0)


_FIELDS = ("v", "op", "id", "src", "keys", "meta")
_OPS = Op._value2member_map_

# Error texts quote what came in through this: short, and never deeper than a few levels.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_show = _REPR.repr
quote = _REPR.repr      # for logs too: a bounded extract, control characters escaped (no forged lines)


class Header:
    """A decoded message header; see the module docstring for the fields. `arrived` is local, never
    sent: the time.time() at which a server took the request, when its telemetry times requests."""
    __slots__ = ("op", "id", "src", "keys", "meta", "arrived")

    def __init__(self, op, id=0, src="?", keys=(), meta=None):
        self.op = op if type(op) is Op else Op(op)
        self.id = id
        self.src = src
        self.keys = list(keys)
        self.meta = {} if meta is None else meta
        self.arrived = None

    @classmethod
    def decoded(cls, op, id, src, keys, meta):
        """A Header from fields decode() has checked (op an Op, keys a fresh list of Entry)."""
        header = cls.__new__(cls)
        header.op, header.id, header.src, header.keys, header.meta, header.arrived = op, id, src, keys, meta, None
        return header

    def encode(self):
        """The header frame; raises ProtocolError for one no peer would decode (see MAX_HEADER_BYTES)."""
        if len(self.keys) > MAX_ENTRIES:
            raise ProtocolError(f"{self.op.name} has {len(self.keys)} entries; a message carries at most "
                                f"{MAX_ENTRIES} (MAX_ENTRIES)")
        frame = msgpack.packb({"v": VERSION, "op": int(self.op), "id": self.id, "src": self.src,
                               "keys": [[e[0], e[1], int(e[2]), list(e[3]), e[4]] for e in self.keys],
                               "meta": self.meta}, use_bin_type=True)
        if len(frame) > MAX_HEADER_BYTES:
            raise ProtocolError(f"{self.op.name} header is {len(frame)} bytes; a header holds at most "
                                f"{MAX_HEADER_BYTES} (MAX_HEADER_BYTES)")
        return frame

    def __repr__(self):
        nbytes = sum(e.nbytes for e in self.keys)
        src = self.src if len(self.src) <= 40 and self.src.isprintable() else _show(self.src)   # from a peer
        return f"{src} {self.op.name} id={self.id} keys={len(self.keys)} {_size(nbytes)}"


def _size(n):
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n}{unit}"
        n //= 1024
    return f"{n}GB"


def decode(frame):
    """Decode and validate a header frame; raises ProtocolError naming the bad field."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(frame)} bytes; a header holds at most {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, max_bin_len=1 << 20,
                              max_str_len=1 << 20, max_array_len=MAX_ENTRIES, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not (type(raw) is dict):
        raise ProtocolError(f"header is a {type(raw).__name__}, not a map")
    version = raw.get("v")
    if not (type(version) is int and version == VERSION):
        raise VersionMismatch(f"peer speaks kvps protocol version {_show(version)}, this node speaks {VERSION}")
    try:
        op, request_id, src, keys, meta = raw["op"], raw["id"], raw["src"], raw["keys"], raw["meta"]
    except KeyError:
        op = None
    if not (op is not None and len(raw) == len(_FIELDS)):
        raise ProtocolError(f"header fields {_show(sorted(map(str, raw)))} are not {list(_FIELDS)}")
    if not (type(op) is int and op in _OPS):
        raise ProtocolError(f"unknown op {_show(op)}")
    if not (type(request_id) is int):
        raise ProtocolError(f"id {_show(request_id)} is not an int")
    if not (type(src) is str):
        raise ProtocolError(f"src {_show(src)} is not a str")
    if not (type(meta) is dict):
        raise ProtocolError(f"meta is a {type(meta).__name__}, not a map")
    if not (type(keys) is list):
        raise ProtocolError(f"keys is a {type(keys).__name__}, not a list")
    op = _OPS[op]
    checks, required = _META[op]
    if meta or required:
        _check_meta(op, meta, checks, required)
    return Header.decoded(op, request_id, src, [_entry(e) for e in keys], meta)


def _check_meta(op, meta, checks, required):
    for name, value in meta.items():
        accepts = checks.get(name)
        if accepts is None or not accepts(value):
            _refuse_meta(op, name, value)
    for name in required:
        if name not in meta:
            raise ProtocolError(f"{op.name} meta lacks the required field {name!r} ({SCHEMA[op].meta[name].type})")


def _refuse_meta(op, name, value):
    fields = SCHEMA[op].meta
    if name not in fields:
        takes = f"takes {', '.join(fields)}" if fields else "takes no meta"
        raise ProtocolError(f"{op.name} meta has an unknown field {_show(name)} ({op.name} {takes})")
    raise ProtocolError(f"{op.name} meta field {name!r} is {_show(value)}, expected {fields[name].type}")


def _entry(e):
    if not (type(e) is list and len(e) == 5):
        raise ProtocolError(f"entry {_show(e)} is not [key, part, dtype, shape, nbytes]")
    key, part, dtype, shape, nbytes = e
    if not (type(key) is int or type(key) is str):
        raise ProtocolError(f"key {_show(key)} is not an int or str")
    if not (type(part) is int and part >= 0):
        raise ProtocolError(f"part {_show(part)} of key {_show(key)} is not a part index")
    if not (type(dtype) is int and 0 <= dtype < len(BY_CODE)):
        raise ProtocolError(f"dtype {_show(dtype)} of key {_show(key)} is unknown")
    if not (type(shape) is list and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"shape {_show(shape)} of key {_show(key)} is not a list of sizes (at most {MAX_NDIM})")
    if not (type(nbytes) is int and nbytes >= 0):
        raise ProtocolError(f"nbytes {_show(nbytes)} of key {_show(key)} is not a size")
    return tuple.__new__(Entry, (key, part, dtype, tuple(shape), nbytes))


def entries(header, payloads):
    """[(index, entry, its payload frame or None)] of a message: the frames follow the entries that
    carry bytes (nbytes > 0), in order."""
    frames = iter(payloads)
    return [(index, entry, next(frames) if entry.nbytes else None) for index, entry in enumerate(header.keys)]


def unpack(frames):
    """Split a received multipart message into (Header, payload frames) and check the payload sizes
    (a BUNDLE's payloads are the frames of its messages: see unbundle)."""
    if not (len(frames) >= 1):
        raise ProtocolError("empty message")
    first = frames[0]
    header = decode(first.buffer if hasattr(first, "buffer") else first)
    payloads = frames[1:]
    if header.op is Op.BUNDLE:
        return header, payloads
    carrying = [e for e in header.keys if e[4] > 0]
    want = len(carrying)
    if not (len(payloads) == want):
        raise ProtocolError(f"{header.op.name} declares {want} payload frames, carries {len(payloads)}")
    for entry, frame in zip(carrying, payloads):
        got = len(frame)
        if not (got == entry.nbytes):
            raise ProtocolError(f"payload of key {_show(entry.key)} part {entry.part} has {got} bytes, "
                                f"header says {entry.nbytes}")
        count = 1
        for d in entry.shape:
            count *= d
        if not (count * BY_CODE[entry.dtype].itemsize == entry.nbytes):
            raise ProtocolError(f"payload of key {_show(entry.key)} part {entry.part} has {entry.nbytes} bytes, "
                                f"but {BY_CODE[entry.dtype]} {_show(entry.shape)} needs "
                                f"{count * BY_CODE[entry.dtype].itemsize}")
    return header, payloads


def bundle(name, messages):
    """The frames of one BUNDLE from `name` carrying `messages` (each a list of frames: header first)."""
    header = Header(Op.BUNDLE, 0, name, meta={"counts": [len(m) for m in messages]})
    return [header.encode(), *(frame for m in messages for frame in m)]


def unbundle(header, payloads):
    """The frames of each message of a BUNDLE, in order; raises ProtocolError when its counts do not
    cut its frames into messages of at least one frame."""
    counts = header.meta["counts"]
    if sum(counts) != len(payloads) or any(c < 1 for c in counts):
        raise ProtocolError(f"BUNDLE counts {_show(counts)} do not cut its {len(payloads)} frames into messages")
    out, at = [], 0
    for count in counts:
        out.append(payloads[at:at + count])
        at += count
    return out


def as_array(frame, entry):
    """A read-only numpy view of a payload frame (no copy)."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buf, dtype=BY_CODE[entry.dtype]).reshape(entry.shape)


def error_header(request_id, src, kind, message):
    return Header(Op.ERROR, request_id, src, meta={"kind": kind, "message": message})
