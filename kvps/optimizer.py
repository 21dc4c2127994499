"""Optimizers that run on the servers, described by name and parameters (never pickled).

    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))

The worker only sends {"name": ..., "params": {...}}; the servers look the name
up among the update rules their operator installed (kvps.ps.rules, plus
any --plugin module), so no code travels over the network. The formulas are
MXNet's; docs/optimizers.md writes them out.
"""


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


def create(name, **params):
    """An optimizer by name (MXNet's mx.optimizer.create); unknown names become a generic
    Optimizer for a rule the server operator installed."""
    cls = _BUILTIN.get(name.lower())
    return cls(**params) if cls is not None else Optimizer(name, **params)
