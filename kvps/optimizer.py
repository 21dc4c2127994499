"""Optimizers that run on the servers, described by name and parameters (never pickled).

    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))

The worker only sends {"name": ..., "params": {...}}; the servers look the name
up among the update rules their operator installed (kvps.ps.rules, plus
any --plugin module), so no code travels over the network. The formulas are
MXNet's; docs/optimizers.md writes them out. get_updater(optimizer) runs the same formulas in
this process (MXNet's updater, for a local kvstore or a script's own step).
"""
import numpy as np


class Optimizer:
    """A named server-side update rule with its parameters.

    Any rule a server knows can be named here, including one added by the
    server operator's plugin: Optimizer("my_rule", learning_rate=0.1).
    """

    name = None
    defaults = {}

    def __init__(self, name=None, **params):
        if name is not None:
            self.name = name
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"optimizer name must be a non-empty str, got {self.name!r}")
        if self.defaults:
            unknown = sorted(set(params) - set(self.defaults))
            if unknown:
                raise ValueError(f"{type(self).__name__} has no parameter {', '.join(unknown)} "
                                 f"(parameters: {', '.join(self.defaults)})")
        self.params = dict(self.defaults, **params)
        for key, value in self.params.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"optimizer parameter {key}={value!r} must be a number, bool, str or None")

    def spec(self):
        """What travels to the servers."""
        return {"name": self.name, "params": dict(self.params)}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})" if self.defaults else f"Optimizer({self.name!r}, {args})"


_COMMON = {"learning_rate": 0.01, "wd": 0.0, "rescale_grad": 1.0, "clip_gradient": None}


class SGD(Optimizer):
    """weight -= lr * (clip(rescale_grad * grad) + wd * weight), with optional (Nesterov) momentum."""
    name = "sgd"
    defaults = dict(_COMMON, momentum=0.0, nesterov=False)


class NAG(SGD):
    """SGD with Nesterov momentum (MXNet's NAG)."""
    name = "nag"
    defaults = dict(_COMMON, momentum=0.9, nesterov=True)


class Adam(Optimizer):
    name = "adam"
    defaults = dict(_COMMON, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8)


class AdamW(Optimizer):
    """Adam with decoupled weight decay (MXNet contrib adamw_update)."""
    name = "adamw"
    defaults = dict(_COMMON, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, eta=1.0)


class AdaGrad(Optimizer):
    name = "adagrad"
    defaults = dict(_COMMON, epsilon=1e-7)


class RMSProp(Optimizer):
    name = "rmsprop"
    defaults = dict(_COMMON, learning_rate=0.001, gamma1=0.9, epsilon=1e-8)


_BUILTIN = {cls.name: cls for cls in (SGD, NAG, Adam, AdamW, AdaGrad, RMSProp)}


class Updater:
    """MXNet's mx.optimizer.Updater, from get_updater(optimizer): updater(index, grad, weight)
    applies the optimizer to `weight` in place (numpy arrays or torch tensors) with the formulas
    the servers use, keeping each index's state (momentum, moments, step count) between calls. It
    is what MXNet scripts give kv._set_updater() in a local kvstore, or step their weights with
    themselves. Only installed rules run (this process's built-ins), as on a server."""

    def __init__(self, optimizer):
        from kvps.ps.rules import Registry      # (kvps.ps.rules imports this module)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"get_updater takes a kvps.optimizer.Optimizer, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._rule = Registry().create(optimizer.spec())

    def __call__(self, index, grad, weight):
        from kvps.arrays import as_numpy, is_torch
        w, g = as_numpy(weight, f"weight of index {index!r}"), as_numpy(grad, f"grad of index {index!r}")
        if w.shape != g.shape:
            raise ValueError(f"index {index!r}: grad shape {g.shape} differs from weight shape {w.shape}")
        self._rule((index, 0), w, g)
        if is_torch(weight):
            if weight.device.type != "cpu" or w.ctypes.data != weight.data_ptr():
                import torch
                weight.copy_(torch.from_numpy(w) if w.dtype.kind == "f" else
                             torch.from_numpy(w.view(np.int16)).view(torch.bfloat16))
        elif not np.shares_memory(w, weight):
            weight[...] = w


def get_updater(optimizer):
    """MXNet's mx.optimizer.get_updater: an Updater for `optimizer`."""
    return Updater(optimizer)


def create(name, **params):
    """An optimizer by name (MXNet's mx.optimizer.create); unknown names become a generic
    Optimizer for a rule the server operator installed."""
    cls = _BUILTIN.get(name.lower())
    return cls(**params) if cls is not None else Optimizer(name, **params)
