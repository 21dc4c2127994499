"""Learning-rate schedules for the servers' optimizers, with MXNet 1.9's names, arguments and results.

    sched = kvps.lr_scheduler.FactorScheduler(step=1000, factor=0.9)
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, lr_scheduler=sched))

A schedule is a description (a name and numbers, `spec()`), like an optimizer: the servers build it
from their own copy of this module, so no code travels. `sched(num_update)` is the learning rate
after `num_update` updates, where, as in MXNet, num_update is the largest number of updates that
the optimizer has applied to any one key (on a server: to any key it holds). Here it is a function
of num_update alone, where MXNet's objects step through it call by call; the two agree for the
increasing num_update an optimizer feeds them, and a server that restarts from a checkpoint or
takes over a dead one's keys needs nothing but the update counts.

As in MXNet, an optimizer's learning_rate, when given, replaces the schedule's base_lr (the rate
its decay starts from); a warm-up still ends at the base_lr the schedule was made with, and the
polynomial and cosine schedules decay from theirs (MXNet 1.9 keeps those apart in the same way).
"""
import math

WARMUP_MODES = ("linear", "constant")


class LRScheduler:
    """The learning rate as a function of the number of updates; subclasses define decay()."""

    name = None

    def __init__(self, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
        if warmup_begin_lr > base_lr:
            raise ValueError(f"warmup_begin_lr={warmup_begin_lr} is above base_lr={base_lr}")
        if warmup_mode not in WARMUP_MODES:
            raise ValueError(f"warmup_mode={warmup_mode!r} is not one of {', '.join(WARMUP_MODES)}")
        self.base_lr = base_lr                    # where the decay starts (an optimizer's learning_rate replaces it)
        self.warmup_final_lr = base_lr            # where a warm-up ends (MXNet keeps it when base_lr is replaced)
        self.warmup_steps = warmup_steps
        self.warmup_begin_lr = warmup_begin_lr
        self.warmup_mode = warmup_mode

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            if self.warmup_mode == "constant":
                return self.warmup_begin_lr
            return self.warmup_begin_lr + (self.warmup_final_lr - self.warmup_begin_lr) * \
                float(num_update) / float(self.warmup_steps)
        return self.decay(num_update)

    def decay(self, num_update):
        raise NotImplementedError

    def params(self):
        """The numbers that make this schedule (spec's "params")."""
        return {"base_lr": self.base_lr, "warmup_final_lr": self.warmup_final_lr, "warmup_steps": self.warmup_steps,
                "warmup_begin_lr": self.warmup_begin_lr, "warmup_mode": self.warmup_mode}

    def spec(self):
        """What travels to the servers: {"name", "params"}."""
        return {"name": self.name, "params": self.params()}

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"


class _Stepped(LRScheduler):
    """A rate multiplied by `factor` at some update counts, as MXNet multiplies it: one step at a
    time, in float, so the rates are MXNet's to the bit; the last (count, rate) is remembered."""

    def __init__(self, factor, **common):
        super().__init__(**common)
        if factor > 1.0:
            raise ValueError(f"factor={factor} must be at most 1 (the rate only decreases)")
        self.factor = factor
        self._last = (0, None)      # (steps taken, the rate after them), from the base_lr in _start
        self._start = None

    def steps(self, num_update):
        raise NotImplementedError

    def floor(self, lr):
        return lr

    def decay(self, num_update):
        taken, lr = self._last
        want = self.steps(num_update)
        if lr is None or want < taken or self._start != self.base_lr:
            taken, lr, self._start = 0, self.base_lr, self.base_lr
        for _ in range(want - taken):
            lr = self.floor(lr * self.factor)
        self._last = (want, lr)
        return lr


class FactorScheduler(_Stepped):
    """The rate times `factor` every `step` updates (after the first `step`), never below
    stop_factor_lr: base_lr * factor ** ((num_update - 1) // step)."""
    name = "factor"

    def __init__(self, step, factor=1, stop_factor_lr=1e-8, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(factor, base_lr=base_lr, warmup_steps=warmup_steps, warmup_begin_lr=warmup_begin_lr,
                         warmup_mode=warmup_mode)
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"step={step!r} must be an int >= 1 (updates between two changes of the rate)")
        self.step, self.stop_factor_lr = step, stop_factor_lr

    def steps(self, num_update):
        return max(0, (num_update - 1) // self.step)

    def floor(self, lr):
        return max(lr, self.stop_factor_lr)

    def params(self):
        return dict(super().params(), step=self.step, factor=self.factor, stop_factor_lr=self.stop_factor_lr)


class MultiFactorScheduler(_Stepped):
    """The rate times `factor` once num_update passes each count in `step` (an increasing list)."""
    name = "multifactor"

    def __init__(self, step, factor=1, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0, warmup_mode="linear"):
        super().__init__(factor, base_lr=base_lr, warmup_steps=warmup_steps, warmup_begin_lr=warmup_begin_lr,
                         warmup_mode=warmup_mode)
        if not isinstance(step, (list, tuple)) or not step or \
                any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in step) or \
                any(b <= a for a, b in zip(step, step[1:])):
            raise ValueError(f"step={step!r} must be an increasing list of ints >= 1")
        self.step = list(step)

    def steps(self, num_update):
        return sum(1 for s in self.step if num_update > s)

    def params(self):
        return dict(super().params(), step=list(self.step), factor=self.factor)


class _Curve(LRScheduler):
    """A rate that falls from base_lr to final_lr along a curve over max_update updates (after the
    warm-up), then stays at final_lr's end of it."""

    def __init__(self, max_update, final_lr=0, **common):
        super().__init__(**common)
        if not isinstance(max_update, int) or isinstance(max_update, bool) or max_update < 1:
            raise ValueError(f"max_update={max_update!r} must be an int >= 1")
        if max_update <= self.warmup_steps:
            raise ValueError(f"max_update={max_update} must be above warmup_steps={self.warmup_steps}")
        self.max_update, self.final_lr = max_update, final_lr
        self.base_lr_orig = self.base_lr       # the curve's start: MXNet keeps it when base_lr is replaced

    def decay(self, num_update):
        done = (min(num_update, self.max_update) - self.warmup_steps) / float(self.max_update - self.warmup_steps)
        return self.final_lr + (self.base_lr_orig - self.final_lr) * self.curve(done)

    def curve(self, done):
        raise NotImplementedError

    def params(self):
        return dict(super().params(), max_update=self.max_update, final_lr=self.final_lr,
                    base_lr_orig=self.base_lr_orig)


class PolyScheduler(_Curve):
    """final_lr + (base_lr - final_lr) * (1 - done) ** pwr, done the share of max_update behind."""
    name = "poly"

    def __init__(self, max_update, base_lr=0.01, pwr=2, final_lr=0, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(max_update, final_lr, base_lr=base_lr, warmup_steps=warmup_steps,
                         warmup_begin_lr=warmup_begin_lr, warmup_mode=warmup_mode)
        if pwr < 0:
            raise ValueError(f"pwr={pwr} must be >= 0")
        self.pwr = pwr

    def curve(self, done):
        return pow(1 - done, self.pwr)

    def params(self):
        return dict(super().params(), pwr=self.pwr)


class CosineScheduler(_Curve):
    """final_lr + (base_lr - final_lr) * (1 + cos(pi * done)) / 2."""
    name = "cosine"

    def __init__(self, max_update, base_lr=0.01, final_lr=0, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(max_update, final_lr, base_lr=base_lr, warmup_steps=warmup_steps,
                         warmup_begin_lr=warmup_begin_lr, warmup_mode=warmup_mode)

    def curve(self, done):
        return (1 + math.cos(math.pi * done)) / 2


SCHEDULERS = {cls.name: cls for cls in (FactorScheduler, MultiFactorScheduler, PolyScheduler, CosineScheduler)}
_DERIVED = ("warmup_final_lr", "base_lr_orig")       # set by the constructors from base_lr, then restored


def from_spec(spec):
    """The schedule a spec() describes (what a server builds); raises ValueError naming what is wrong."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("params"), dict):
        raise ValueError(f"lr_scheduler spec {spec!r} is not {{'name': str, 'params': dict}}")
    cls = SCHEDULERS.get(spec["name"])
    if cls is None:
        raise ValueError(f"no lr_scheduler {spec['name']!r} (there are: {', '.join(SCHEDULERS)})")
    params = dict(spec["params"])
    for key, value in params.items():
        numbers = value if key == "step" and isinstance(value, list) else [value]
        if key != "warmup_mode" and not all(type(v) in (int, float) and math.isfinite(v) for v in numbers):
            raise ValueError(f"lr_scheduler {spec['name']!r} parameter {key}={value!r} is not a finite number")
    derived = {name: params.pop(name) for name in _DERIVED if name in params}
    start = params.get("base_lr")
    if "warmup_final_lr" in derived:
        params["base_lr"] = derived["warmup_final_lr"]     # what it was made with, as the checks saw it
    try:
        sched = cls(**params)
    except TypeError as exc:
        raise ValueError(f"lr_scheduler {spec['name']!r}: {exc}") from None
    for name, value in derived.items():
        setattr(sched, name, value)
    if start is not None:
        sched.base_lr = start
    return sched
