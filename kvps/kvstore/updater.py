"""MXNet's mx.optimizer.get_updater on kvps's update rules: step weights in this process with the
formulas the servers use (a local kvstore's kv._set_updater, or a script's own step).

    updater = kvps.optimizer.get_updater(kvps.optimizer.Adam(learning_rate=0.01))
    updater(index, grad, weight)         # weight changes in place; each index keeps its state

kvps/__init__.py binds get_updater and Updater into kvps.optimizer, MXNet's place for them (the
optimizer descriptions sit below the rules in the layers, so they cannot import them).
"""
import numpy as np

from kvps.arrays import Out, as_numpy, is_torch
from kvps.optimizer import Optimizer
from kvps.ps.rules import Registry


class Updater:
    """MXNet's mx.optimizer.Updater, from get_updater(optimizer): updater(index, grad, weight)
    applies the optimizer to `weight` in place (numpy arrays or torch tensors) with the formulas
    the servers use, keeping each index's state (momentum, moments, step count) between calls. It
    is what MXNet scripts give kv._set_updater() in a local kvstore, or step their weights with
    themselves. Only installed rules run (this process's built-ins), as on a server."""

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"get_updater takes a kvps.optimizer.Optimizer, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._rule = Registry().create(optimizer.spec())

    def __call__(self, index, grad, weight):
        out, g = Out(weight, f"weight of index {index!r}"), as_numpy(grad, f"grad of index {index!r}")
        w = out.array
        if w.shape != g.shape:
            raise ValueError(f"index {index!r}: grad shape {g.shape} differs from weight shape {w.shape}")
        if out.copy_back and not is_torch(weight):
            np.copyto(w, weight)            # (Out gives a strided numpy array an empty buffer to fill)
        self._rule((index, 0), w, g)
        out.finish()                        # the weight is the buffer, or gets it back (CUDA, strided)


def get_updater(optimizer):
    """MXNet's mx.optimizer.get_updater: an Updater for `optimizer`."""
    return Updater(optimizer)
