"""Hostile messages for a daemon port: every kind of input a broken or lying peer can send.

    frames = Hostile(random.Random(7), target="server")
    kind, message = frames.next()          # message: a list of frames (bytes) for a DEALER

Kinds (KINDS): random bytes, valid msgpack with wrong field types, huge declared shapes, wrong
frame counts, unknown ops, truncated and mutated messages, nesting about 1,000 levels deep in
every header field (entry and meta fields included), huge entry counts and headers, sender names
that only look canonical (W00, an Arabic-Indic zero, a newline), repeated or out-of-range row ids.

None of them can change a job's state: the requests that would (REGISTER, INIT, PUSH, ...) come
from senders that are not in the job ("Z9", two byte flips away from a real name) or carry a role
that does not exist, so a real job run beside the fuzzer must still get exact results.
"""
import random

import msgpack

from kvps.wire.protocol import MAX_ENTRIES, MAX_HEADER_BYTES, VERSION, Op

KINDS = ("random_bytes", "wrong_types", "huge_shape", "frame_count", "unknown_op", "truncated", "mutated",
         "deep", "many_entries", "bad_src", "rows")
FIELDS = ("v", "op", "id", "src", "keys", "meta")
STRANGER = "Z9"                 # a sender no job has
BAD_NAMES = ("W00", "W\u0660", "W0\n2099-01-01 00:00:00 kvps-server ERROR forged line", "W-0", "W+0", "w0",
             "W99999999999999999999", "S0", "H", "", "\x1b[31mW0", "W0 ", "\u2028W0")


def _pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


def _header(op, id=1, src=STRANGER, keys=(), meta=None):
    return {"v": VERSION, "op": int(op), "id": id, "src": src, "keys": [list(k) for k in keys], "meta": meta or {}}


def _raw_map(items):
    """A msgpack map from already-packed (key, value) byte pairs (to splice in raw nesting)."""
    out = bytearray()
    n = len(items)
    out += bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    for k, v in items:
        out += k + v
    return bytes(out)


class Hostile:
    """An endless supply of hostile messages for one daemon ("scheduler" or "server")."""

    def __init__(self, rng=None, target="server"):
        self.rng = rng or random.Random()
        self.target = target
        self._built = {}            # the big messages, built once

    def next(self, kind=None):
        """(kind, frames); one message in a thousand is a header just over MAX_HEADER_BYTES."""
        if kind is None:
            kind = "huge_header" if self.rng.random() < 0.001 else self.rng.choice(KINDS)
        return kind, getattr(self, "_" + kind)()

    def _once(self, name, build):
        if name not in self._built:
            self._built[name] = build()
        return self._built[name]

    # ---- helpers ----
    def _value(self, depth=0):
        """A random msgpack value of any type (shallow)."""
        r = self.rng
        choice = r.randrange(10 if depth < 2 else 7)
        if choice == 0:
            return None
        if choice == 1:
            return r.choice((True, False))
        if choice == 2:
            return r.choice((0, -1, 1, 2 ** 31, -2 ** 63, 2 ** 64 - 1, r.randrange(-1000, 1000)))
        if choice == 3:
            return r.choice((0.0, -1.5, float("inf"), float("nan"), 1e308))
        if choice == 4:
            return r.choice(("", "x", "W0", "\n", "\x00" * 8, "é" * 5)) + "".join(
                chr(r.randrange(32, 0x2fff)) for _ in range(r.randrange(8)))
        if choice == 5:
            return r.randbytes(r.randrange(16))
        if choice == 6:
            return r.randrange(1 << 20)
        if choice in (7, 8):
            return [self._value(depth + 1) for _ in range(r.randrange(4))]
        return {str(self._value(depth + 1)): self._value(depth + 1) for _ in range(r.randrange(4))}

    def _nesting(self, levels=None):
        """Raw msgpack nested `levels` deep (lists or maps), about a kilobyte or two."""
        levels = levels or self.rng.choice((500, 990, 1000, 1023, 1024, 1100, 3000))
        if self.rng.random() < 0.5:
            return b"\x91" * levels + b"\x01"
        return b"\x81\xa1k" * levels + b"\x01"

    def _template(self):
        """A well-formed header of an op this daemon takes, that cannot change a job's state."""
        r = self.rng
        if self.target == "scheduler":
            op = r.choice((Op.REGISTER, Op.BARRIER, Op.HEARTBEAT, Op.FINALIZE, Op.PULL))
            meta = {Op.REGISTER: {"role": "nobody", "host": "127.0.0.1", "port": 1, "pid": 1, "rank": 0},
                    Op.BARRIER: {"group": "workers"}}.get(op, {})
            return _header(op, r.randrange(1 << 30), meta=meta), []
        op = r.choice((Op.PUSH, Op.PULL, Op.INIT, Op.ROW_SPARSE_PULL, Op.PUSHPULL, Op.STATS, Op.JOIN))
        if op in (Op.PUSH, Op.PUSHPULL, Op.INIT):
            n = r.randrange(1, 9)
            return _header(op, r.randrange(1 << 30), keys=[["k", 0, 0, [n], 4 * n]]), [b"\0" * (4 * n)]
        if op == Op.ROW_SPARSE_PULL:
            return _header(op, r.randrange(1 << 30), keys=[["k", 0, 5, [2], 16]]), [b"\0" * 16]
        return _header(op, r.randrange(1 << 30), keys=[["k", 0, 0, [4], 0]] if op == Op.PULL else []), []

    # ---- the kinds ----
    def _random_bytes(self):
        r = self.rng
        return [r.randbytes(r.choice((0, 1, 2, 7, 64, 1024))) for _ in range(r.choice((1, 1, 1, 2, 5)))]

    def _wrong_types(self):
        header, payloads = self._template()
        r = self.rng
        if r.random() < 0.5:
            header[r.choice(FIELDS)] = self._value()
        elif r.random() < 0.5 and header["keys"]:
            entry = header["keys"][0]
            entry[r.randrange(5)] = self._value()
        else:
            header["meta"] = dict(header["meta"], **{r.choice(("role", "host", "port", "pid", "group", "codec",
                                                               "spec", "generation", "rank", "zzz")): self._value()})
        if r.random() < 0.2:
            del header[r.choice(FIELDS)]
        if r.random() < 0.1:
            header["extra"] = 1
        return [_pack(header), *payloads]

    def _huge_shape(self):
        r = self.rng
        shape = r.choice(([2 ** 40, 2 ** 40], [2 ** 63 - 1], [2 ** 31] * 3, [0, 2 ** 62], [1] * 65, [2 ** 64 - 1]))
        op = r.choice((Op.PUSH, Op.INIT, Op.PULL, Op.ROW_SPARSE_PULL, Op.PUSHPULL))
        nbytes = r.choice((0, 8))
        return [_pack(_header(op, 5, keys=[["k", 0, r.randrange(8), shape, nbytes]])), *([b"\0" * 8] if nbytes else [])]

    def _frame_count(self):
        header, payloads = self._template()
        header["keys"] = [["k", 0, 0, [2], 8], ["j", 0, 0, [2], 8]]
        return [_pack(header)] + [b"\0" * 8] * self.rng.choice((0, 1, 3, 50))

    def _unknown_op(self):
        header, payloads = self._template()
        header["op"] = self.rng.choice((0, 11, 19, 30, 41, 255, -1, 2 ** 40))
        return [_pack(header), *payloads]

    def _truncated(self):
        header, payloads = self._template()
        frame = _pack(header)
        cut = [frame[:self.rng.randrange(len(frame))]]
        if payloads and self.rng.random() < 0.5:
            return [frame, payloads[0][:len(payloads[0]) // 2]]
        return cut

    def _mutated(self):
        header, payloads = self._template()
        frame = bytearray(_pack(header))
        for _ in range(self.rng.randrange(1, 4)):
            frame[self.rng.randrange(len(frame))] = self.rng.randrange(256)
        return [bytes(frame), *payloads]

    def _deep(self):
        """Nesting about 1,000 levels deep in one header field, entry field or meta field."""
        header, payloads = self._template()
        r = self.rng
        where = r.choice(FIELDS + ("entry", "meta field"))
        items = []
        for name in FIELDS:
            value = header[name]
            if name == where:
                packed = self._nesting()
            elif name == "keys" and where == "entry":
                entry = list(header["keys"][0]) if header["keys"] else ["k", 0, 0, [1], 0]
                at = r.randrange(5)
                packed = b"\x91\x95" + b"".join(self._nesting() if i == at else _pack(x) for i, x in enumerate(entry))
            elif name == "meta" and where == "meta field":
                fields = list(value) or ["role"]
                at = r.choice(fields)
                packed = _raw_map([(_pack(k), self._nesting() if k == at else _pack(value.get(k)))
                                   for k in dict.fromkeys(fields)])
            else:
                packed = _pack(value)
            items.append((_pack(name), packed))
        return [_raw_map(items), *payloads]

    def _many_entries(self):
        r = self.rng
        choice = r.randrange(4)
        if choice == 0:         # a list header declaring millions of entries, then only a few bytes
            head = _pack(_header(Op.PULL))
            at = head.index(b"\xa4keys") + 5
            return [head[:at] + b"\xdd" + (6_000_000).to_bytes(4, "big") + b"\x95\x01\x00\x00\x91\x04\x00" * 4]
        if choice == 1:         # just over MAX_ENTRIES real entries
            return self._once("entries", lambda: [_pack(_header(Op.PULL, keys=[[i, 0, 0, [1], 0]
                                                                             for i in range(MAX_ENTRIES + 1)]))])
        if choice == 2:         # a map of 60,000 meta fields
            return self._once("meta", lambda: [_pack(_header(Op.PULL, meta={str(i): i for i in range(60_000)}))])
        return self._once("dims", lambda: [_pack(_header(Op.PULL, keys=[[i, 0, 0, [1] * 60, 0]
                                                                         for i in range(2000)]))])

    def _huge_header(self):
        """A header just over MAX_HEADER_BYTES."""
        return self._once("huge", lambda: [b"\x81\xa1v" + b"\xc6" + (MAX_HEADER_BYTES).to_bytes(4, "big")
                                           + b"\x00" * MAX_HEADER_BYTES])

    def _bad_src(self):
        header, payloads = self._template()
        header["src"] = self.rng.choice(BAD_NAMES)
        if header["op"] == int(Op.REGISTER):
            header["meta"]["role"] = self.rng.choice(("worker\n", ["worker"], "server "))
        return [_pack(header), *payloads]

    def _rows(self):
        r = self.rng
        ids = r.choice(([0] * 5000, [3, 1, 2], [-1], [2 ** 62], [0, 0], list(range(100))))
        payload = b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
        keys = [["k", 0, 5, [len(ids)], len(payload)]] * r.choice((1, 2))
        return [_pack(_header(Op.ROW_SPARSE_PULL, keys=keys)), *[payload] * len(keys)]

