"""The test-only fault injector: lost, duplicated and late data messages (ps-lite's PS_DROP_MSG).

    KVPS_FAULTS=drop:0.01,dup:0.01,delay:5ms KVPS_FAULTS_SEED=7 kvps launch -n 2 -s 2 -- python train.py

    faults = Faults.parse("drop:0.01,dup:0.01,delay:5ms", seed=7, node="worker", rank=1)
    faults.decide(Op.PUSH)          # (copies, delay in s): (0, 0) drop, (2, 0) duplicate, (1, 0.003) late

The transport asks `decide` once per message it sends, and only for data messages (a worker's
requests to servers, a server's replies; never the scheduler's control plane, whose heartbeats have
no resend, nor a ring's chunks). A worker resends what is not answered after KVPS_RESEND_TIMEOUT and
the server answers a request id once (kvps/wire/window.py), so a job under faults gives the results
of a clean one. A delay is at most the given time, and never lets a message overtake an earlier one
to the same peer: the faults lose and repeat messages, they do not reorder a connection.

Each node draws from its own generator seeded by (seed, role, rank), so a run's faults are
reproducible for the same interleaving of messages.
"""
import dataclasses
import random
import re

from kvps.errors import ConfigError
from kvps.wire.protocol import Op

# What the injector may touch: data requests and the replies a server sends to them.
DATA_OPS = frozenset({Op.INIT, Op.PUSH, Op.PULL, Op.PUSHPULL, Op.ROW_SPARSE_PULL, Op.ROW_SPARSE_PUSH,
                      Op.SET_OPTIMIZER, Op.STATS, Op.JOIN, Op.ACK, Op.ERROR, Op.VALUE})

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_KINDS = ("drop", "dup", "delay")


def _probability(kind, text, spec):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 <= value < 1.0:
        raise ConfigError(f"KVPS_FAULTS={spec!r}: {kind}:{text} needs a probability in [0, 1)")
    return value


def _duration(text, spec):
    match = re.fullmatch(r"(\d+(?:\.\d*)?)(s|ms|us)", text)
    if match is None:
        raise ConfigError(f"KVPS_FAULTS={spec!r}: delay:{text} needs a time such as 5ms, 200us or 0.1s")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value > 10.0:
        raise ConfigError(f"KVPS_FAULTS={spec!r}: delay:{text} is over 10 s (the heartbeat would go first)")
    return value


@dataclasses.dataclass
class Faults:
    """The faults of one node: probabilities of drop and duplication, and the largest delay."""
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0              # seconds, at most; each message draws uniformly in [0, delay]
    seed: int = 0
    node: str = ""
    rank: int = -1
    counts: dict = dataclasses.field(default_factory=lambda: {"dropped": 0, "duplicated": 0, "delayed": 0})

    def __post_init__(self):
        self._random = random.Random(f"{self.seed}/{self.node}/{self.rank}")

    @classmethod
    def parse(cls, spec, seed=0, node="", rank=-1):
        """The Faults of a KVPS_FAULTS spec: comma-separated drop:P, dup:P, delay:T, each at most
        once. Raises ConfigError naming the bad item."""
        values = {}
        for item in spec.split(","):
            kind, sep, text = item.strip().partition(":")
            if not sep or kind not in _KINDS:
                raise ConfigError(f"KVPS_FAULTS={spec!r}: {item.strip()!r} is not drop:P, dup:P or delay:T")
            if kind in values:
                raise ConfigError(f"KVPS_FAULTS={spec!r} gives {kind} twice")
            values[kind] = _duration(text, spec) if kind == "delay" else _probability(kind, text, spec)
        return cls(seed=seed, node=node, rank=rank, **values)

    @classmethod
    def of_config(cls, cfg, node):
        """The faults a node of `cfg` injects (None: KVPS_FAULTS unset)."""
        return cls.parse(cfg.faults, cfg.faults_seed, node, cfg.rank) if cfg.faults else None

    def decide(self, op):
        """(copies, delay) for one message with this op: 0 copies drops it, 2 duplicates it."""
        if op not in DATA_OPS:
            return 1, 0.0
        draw = self._random.random
        if self.drop and draw() < self.drop:
            self.counts["dropped"] += 1
            return 0, 0.0
        copies = 1
        if self.dup and draw() < self.dup:
            self.counts["duplicated"] += 1
            copies = 2
        delay = 0.0
        if self.delay:
            delay = draw() * self.delay
            self.counts["delayed"] += 1
        return copies, delay

    def __str__(self):
        parts = [f"drop:{self.drop:g}" if self.drop else "", f"dup:{self.dup:g}" if self.dup else "",
                 f"delay:{self.delay * 1e3:g}ms" if self.delay else ""]
        return ",".join(p for p in parts if p) or "none"
