"""Medians of repeated runs with 95% bootstrap intervals, and the rule for "no clear difference".

    iv = interval([1.21, 1.05, 1.40])      # Interval(median=1.21, low=1.05, high=1.40, n=3)
    overlap(iv, other)                     # True: the report says "no clear difference"

The interval is the percentile bootstrap of the median: resample the n values with replacement
RESAMPLES times (a fixed seed, so a report can be recomputed), take each resample's median, and
report the 2.5th and 97.5th percentiles of those medians. It assumes nothing about the shape of
the distribution, which for run times is skewed (a slow spell of the machine makes one run long,
never one run short). What it cannot do is see more spread than the runs show: with 3 or 5
repeats the 95% interval is the range of the runs (the smallest resampled median is the
smallest value in more than 2.5% of the resamples), so it is wide and honest, not precise.

A value of None (a run that never reached the target) counts as +inf: it ranks after every run
that did, and a median or a bound that is inf is shown as "not reached". n = 1 gives an interval
of width zero: one run says nothing about spread, and the findings say so.
"""
import collections
import math

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0                   # the bootstrap's own seed: the same runs always give the same interval

Interval = collections.namedtuple("Interval", "median low high n")
Interval.__doc__ = "A median of n values with the bounds of its bootstrap interval (inf: not reached)."


def _finite_or_inf(values):
    return np.array([math.inf if v is None else float(v) for v in values], dtype=np.float64)


def _median(a, axis=None):
    """The median, where inf sorts last (numpy's median of [1, inf] is inf, which is what we want,
    but of [inf, inf] it warns); a middle pair with one inf gives inf, not nan."""
    a = np.sort(a, axis=axis)
    n = a.shape[-1] if axis is not None else a.size
    lo, hi = (n - 1) // 2, n // 2
    if axis is None:
        a = a.ravel()
        x, y = a[lo], a[hi]
        return x if x == y else (math.inf if math.isinf(y) else (x + y) / 2)
    x, y = a[..., lo], a[..., hi]
    with np.errstate(invalid="ignore"):
        mid = np.where(x == y, x, np.where(np.isinf(y), np.inf, (x + y) / 2))
    return mid


def interval(values, level=LEVEL, resamples=RESAMPLES, seed=SEED):
    """Interval(median, low, high, n) of the values (None counts as +inf). Raises ValueError for no
    values, or a level outside (0, 1)."""
    if not 0 < level < 1:
        raise ValueError(f"level {level!r} is not a probability in (0, 1)")
    a = _finite_or_inf(values)
    if a.size == 0:
        raise ValueError("interval() of no values")
    median = float(_median(a))
    if a.size == 1 or np.all(a == a[0]):
        return Interval(median, median, median, int(a.size))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, a.size, size=(resamples, a.size))
    medians = _median(a[picks], axis=1)
    tail = (1 - level) / 2
    # "lower"/"higher": bounds are values the medians took, never an interpolation towards inf
    low = float(np.quantile(medians, tail, method="lower"))
    high = float(np.quantile(medians, 1 - tail, method="higher"))
    return Interval(median, low, high, int(a.size))


def overlap(a, b):
    """True when the two intervals share a point: the data do not tell the two apart."""
    return a.low <= b.high and b.low <= a.high


def as_dict(iv):
    """The interval as results.json holds it (inf written as None: JSON has no infinity)."""
    def plain(v):
        return None if math.isinf(v) else v
    return {"median": plain(iv.median), "low": plain(iv.low), "high": plain(iv.high), "n": iv.n}


def from_dict(d):
    def back(v):
        return math.inf if v is None else v
    return Interval(back(d["median"]), back(d["low"]), back(d["high"]), d["n"])
