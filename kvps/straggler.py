"""Controlled stragglers: slow chosen workers by a fixed or random extra delay per training step.

    kvps launch -n 4 -s 1 --straggler 1=fixed:0.05 --straggler 3=exp:0.02 --straggler-seed 7 -- python train.py

The launcher gives each chosen worker KVPS_STRAGGLER=SPEC (and KVPS_STRAGGLER_SEED).
Its kvstore then sleeps once per training step, before the step's first push, so
training scripts need no change. A step is recognised by its keys: a push that
repeats a key already pushed in the current step starts the next step (every
training loop pushes each gradient once per step; the first push starts step 1).

SPEC is one of
    fixed:SECONDS        the same extra delay every step
    exp:MEAN             exponentially distributed delays with this mean
    uniform:LO:HI        delays drawn uniformly from [LO, HI]
Random delays come from numpy's generator seeded with (seed, rank), so a run repeats.
"""
import dataclasses
import time

import numpy as np

from kvps.errors import ConfigError

KINDS = {"fixed": 1, "exp": 1, "uniform": 2}


@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str
    args: tuple

    def __str__(self):
        return ":".join([self.kind, *(f"{a:g}" for a in self.args)])

    @property
    def mean(self):
        """The expected extra delay per step, in seconds."""
        return sum(self.args) / 2 if self.kind == "uniform" else self.args[0]


def parse(text):
    """A Spec from 'fixed:0.05', 'exp:0.02' or 'uniform:0:0.1'; raises ConfigError naming the text."""
    kind, _, rest = str(text).partition(":")
    if kind not in KINDS:
        raise ConfigError(f"straggler spec {text!r}: the kind must be one of {', '.join(KINDS)} "
                          f"(e.g. fixed:0.05, exp:0.02, uniform:0:0.1)")
    try:
        args = tuple(float(a) for a in rest.split(":")) if rest else ()
    except ValueError:
        raise ConfigError(f"straggler spec {text!r}: {rest!r} are not numbers of seconds") from None
    if len(args) != KINDS[kind]:
        raise ConfigError(f"straggler spec {text!r}: {kind} takes {KINDS[kind]} number(s) of seconds")
    if any(a < 0 or not np.isfinite(a) for a in args) or (kind == "uniform" and args[0] > args[1]):
        raise ConfigError(f"straggler spec {text!r}: delays must be finite, not negative, and LO <= HI")
    return Spec(kind, args)


def parse_assignments(items, num_workers):
    """{rank: Spec} from the launcher's RANK=SPEC options; raises ConfigError naming a bad one."""
    chosen = {}
    for item in items or ():
        rank, sep, spec = item.partition("=")
        if not sep or not rank.strip().isdigit():
            raise ConfigError(f"--straggler {item!r} is not RANK=SPEC (e.g. 1=fixed:0.05)")
        rank = int(rank)
        if rank >= num_workers:
            raise ConfigError(f"--straggler {item!r}: the job has workers 0..{num_workers - 1}")
        if rank in chosen:
            raise ConfigError(f"--straggler names worker {rank} twice")
        chosen[rank] = parse(spec)
    return chosen


class Straggler:
    """Sleeps at the start of each step of one worker; `total` is the time slept so far."""

    def __init__(self, spec, seed=0, rank=0, sleep=time.sleep):
        self.spec = spec
        self.rng = np.random.default_rng([seed, max(rank, 0)])
        self.sleep = sleep
        self.steps = 0
        self.total = 0.0
        self._pushed = set()          # keys pushed in the current step

    @classmethod
    def from_config(cls, cfg, rank):
        """The configured straggler of this worker, or None when it runs at full speed."""
        return cls(parse(cfg.straggler), cfg.straggler_seed, rank) if cfg.straggler else None

    def delay(self):
        kind, args = self.spec.kind, self.spec.args
        if kind == "fixed":
            return args[0]
        if kind == "exp":
            return float(self.rng.exponential(args[0])) if args[0] > 0 else 0.0
        return float(self.rng.uniform(args[0], args[1]))

    def before_push(self, keys):
        """Called with a push's keys before it is sent; sleeps when they start a new step."""
        keys = set(keys)
        if self.steps and not (keys & self._pushed):
            self._pushed |= keys
            return
        self._pushed = keys
        self.steps += 1
        seconds = self.delay()
        self.total += seconds
        if seconds > 0:
            self.sleep(seconds)
