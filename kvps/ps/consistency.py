"""How fresh the values a worker pulls are: the consistency mode of a parameter-server job.

    c = Consistency.parse("ssp", "4", name="dist_ssp:4")     # from a kvstore type string and options
    c.wire()                                                 # "ssp:4": REGISTER meta["mode"]
    Consistency.from_wire("ssp:4") == c                      # strict: a bad string is a ProtocolError
    total_staleness(kv.server_stats())                       # the job's staleness histogram

Modes (docs/consistency.md says how to choose):
    sync          a key's round closes when every worker has pushed; pulls see the whole round
    sync, b > 0   backup workers: a round closes after the first W - b pushes; stale pushes are dropped
    async         pushes are applied on arrival; pulls never wait
    ssp, s        stale synchronous parallel: pushes applied on arrival, but a worker may run at most
                  s pushes ahead of the slowest worker on a key (s = 0: sync's waiting, inf: async)
    geo, k        GEO-SGD (Paddle's geo mode): workers train locally and every k steps push the change
                  of their weights; servers add what arrives (as async without an optimizer) and
                  refuse optimizers; kvps/kvstore/geo.py is the worker's side

The wire string is what every worker sends when it registers, so the scheduler can refuse a job
whose workers disagree, and what the servers build their Store from. Only the canonical spelling
is accepted on the wire ("sync", "async", "ssp:4", "ssp:inf", "sync:backup=1"), so two workers that
mean the same mode always send the same string.
"""
import dataclasses
import math
import numbers
import re

from kvps.errors import ProtocolError

MODES = ("sync", "async", "ssp", "geo")
HOW = {"ssp": "kvps.create('dist_ssp:4') or kvps.create('dist_ssp', staleness=4) (an int >= 0, or 'inf')",
       "geo": "kvps.create('dist_geo:4') or kvps.create('dist_geo', k_steps=4) (an int >= 1)",
       "sync": "kvps.create('dist_sync:backup=1') or kvps.create('dist_sync', backup_workers=1)"}


@dataclasses.dataclass(frozen=True)
class Consistency:
    """A consistency mode; construction validates it (ValueError naming the bad value)."""
    mode: str = "sync"
    staleness: float = 0     # ssp: how many pushes a worker may run ahead of the slowest (int, or math.inf)
    backup: int = 0          # sync: backup workers b (a round closes after W - b pushes)
    k_steps: int = 0         # geo: local steps between two syncs of a key (>= 1)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"consistency mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "ssp":
            _check_staleness(self.staleness)
        elif self.staleness != 0:
            raise ValueError(f"staleness={self.staleness!r} applies to dist_ssp only, not {self.mode}")
        if self.mode == "sync":
            _check_int(self.backup, "backup_workers")
        elif self.backup != 0:
            raise ValueError(f"backup_workers={self.backup!r} applies to dist_sync only, not {self.mode}")
        if self.mode == "geo":
            _check_k_steps(self.k_steps)
        elif self.k_steps != 0:
            raise ValueError(f"k_steps={self.k_steps!r} applies to dist_geo only, not {self.mode}")

    @classmethod
    def parse(cls, mode, suffix="", name=None, staleness=None, backup_workers=None, k_steps=None):
        """The mode of a kvstore type: `mode` from its base name ("ssp" for dist_ssp), `suffix` the
        text after its ':' ("4", "inf", "backup=1"), and create()'s options. Raises ValueError
        naming the type and the bad value; a suffix and an option that disagree are an error too."""
        name = name or (f"{mode}:{suffix}" if suffix else mode)
        for option, value, owner in (("staleness", staleness, "ssp"), ("backup_workers", backup_workers, "sync"),
                                     ("k_steps", k_steps, "geo")):
            if value is not None and mode != owner:
                raise ValueError(f"{option}={value!r} applies to dist_{owner}, not {name!r}")
        if mode == "ssp":
            if suffix and not re.fullmatch(r"\d+|inf", suffix):
                raise ValueError(f"staleness {suffix!r} in kvstore type {name!r} must be an int >= 0 or inf")
            if staleness is not None:
                staleness = math.inf if staleness == "inf" else staleness
                _check_staleness(staleness)
            given = (math.inf if suffix == "inf" else int(suffix)) if suffix else None
            bound = _agree(name, f"staleness {suffix}", given, "staleness", staleness)
            if bound is None:
                raise ValueError(f"kvstore type {name!r} needs a staleness bound: {HOW['ssp']}")
            return cls("ssp", staleness=bound if math.isinf(bound) else int(bound))
        if mode == "sync":
            match = re.fullmatch(r"backup=(\d+)", suffix) if suffix else None
            if suffix and match is None:
                raise ValueError(f"kvstore type {name!r}: {suffix!r} is not 'backup=B' (B an int >= 0); "
                                 f"{HOW['sync']}")
            if backup_workers is not None:
                _check_int(backup_workers, "backup_workers")
            given = int(match.group(1)) if match else None
            return cls("sync", backup=int(_agree(name, suffix, given, "backup_workers", backup_workers) or 0))
        if mode == "geo":
            if suffix and not re.fullmatch(r"\d+", suffix):
                raise ValueError(f"k_steps {suffix!r} in kvstore type {name!r} must be an int >= 1")
            if k_steps is not None:
                _check_k_steps(k_steps)
            k = _agree(name, f"k_steps {suffix}", int(suffix) if suffix else None, "k_steps", k_steps)
            if k is None:
                raise ValueError(f"kvstore type {name!r} needs the steps between syncs: {HOW['geo']}")
            return cls("geo", k_steps=int(k))
        if suffix:
            raise ValueError(f"kvstore type {name!r}: {mode} takes no ':' options")
        return cls(mode)

    def wire(self):
        """The canonical string for REGISTER meta["mode"] (and the server's stats)."""
        if self.mode == "ssp":
            return f"ssp:{'inf' if math.isinf(self.staleness) else int(self.staleness)}"
        if self.mode == "sync" and self.backup:
            return f"sync:backup={self.backup}"
        if self.mode == "geo":
            return f"geo:{self.k_steps}"
        return self.mode

    __str__ = wire

    @classmethod
    def from_wire(cls, text):
        """The mode a wire string names; ProtocolError naming it unless it is canonical."""
        if not isinstance(text, str):
            raise ProtocolError(f"consistency mode {text!r} is a {type(text).__name__}, not a string")
        mode, _, suffix = text.partition(":")
        try:
            if mode not in MODES:
                raise ValueError(f"{mode!r} is not one of {', '.join(MODES)}")
            result = cls.parse(mode, suffix, name=text)
        except ValueError as exc:
            raise ProtocolError(f"bad consistency mode {text!r} in the membership table: {exc}") from None
        if result.wire() != text:
            raise ProtocolError(f"bad consistency mode {text!r} in the membership table: "
                                f"write it as {result.wire()!r}")
        return result

    def check_workers(self, num_workers):
        """Raise ValueError unless this mode can run with `num_workers` workers (0 <= b < W)."""
        if self.backup >= num_workers:
            raise ValueError(f"{self.wire()} asks for {self.backup} backup workers, but the job has "
                             f"{num_workers} worker{'s' if num_workers != 1 else ''}; backups must be "
                             f"fewer than the workers (0 <= b < W)")

    @property
    def bounded(self):
        """True when pulls may have to wait for other workers (sync, and ssp with a finite bound)."""
        return self.mode == "sync" or (self.mode == "ssp" and not math.isinf(self.staleness))


def _agree(name, said, from_suffix, option, value):
    """The one value a type's suffix and create()'s option give (None if neither); ValueError if
    they disagree."""
    if from_suffix is not None and value is not None and from_suffix != value:
        raise ValueError(f"kvstore type {name!r} says {said}, but {option}={value!r}")
    return from_suffix if from_suffix is not None else value


def _check_int(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what}={value!r} must be an int >= 0")


def _check_k_steps(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"k_steps={value!r} must be an int >= 1 (local steps between two syncs)")


def _check_staleness(value):
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"staleness={value!r} must be an int >= 0, or math.inf / 'inf' (never wait)")


def total_staleness(stats):
    """One staleness histogram for the job from kv.server_stats() ({server: meta}): index i counts
    the pushes applied i updates after their worker last pulled that key, summed over servers."""
    total = []
    for meta in stats.values():
        for i, count in enumerate(meta.get("staleness", ())):
            if i == len(total):
                total.append(0)
            total[i] += count
    return total
