"""Optimizers that run on the servers, described by name and parameters (never pickled).

    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))
    kv.set_optimizer(kvps.optimizer.SGD(momentum=0.9, lr_scheduler=kvps.lr_scheduler.FactorScheduler(1000, 0.9)))

The worker only sends {"name": ..., "params": {...}}; the servers look the name
up among the update rules their operator installed (kvps.ps.rules, plus
any --plugin module), so no code travels over the network. The formulas are
MXNet's; docs/optimizers.md writes them out. get_updater(optimizer) (kvps/kvstore/updater.py, bound
here by the package) runs the same formulas in this process: MXNet's updater, for a local kvstore
or a script's own step.
"""
from kvps import lr_scheduler as schedules


class Optimizer:
    """A named server-side update rule with its parameters.

    Any rule a server knows can be named here, including one added by the
    server operator's plugin: Optimizer("my_rule", learning_rate=0.1).
    """

    name = None
    defaults = {}

    def __init__(self, name=None, lr_scheduler=None, **params):
        if name is not None:
            self.name = name
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"optimizer name must be a non-empty str, got {self.name!r}")
        if lr_scheduler is not None:
            if not isinstance(lr_scheduler, schedules.LRScheduler):
                raise ValueError(f"lr_scheduler must be a kvps.lr_scheduler schedule (FactorScheduler, "
                                 f"MultiFactorScheduler, PolyScheduler, CosineScheduler), not {lr_scheduler!r}")
            if params.get("learning_rate") is None:
                params["learning_rate"] = lr_scheduler.base_lr
            else:       # MXNet: the optimizer's learning_rate replaces the schedule's base_lr
                lr_scheduler.base_lr = params["learning_rate"]
        self.lr_scheduler = lr_scheduler
        if self.defaults:
            unknown = sorted(set(params) - set(self.defaults))
            if unknown:
                raise ValueError(f"{type(self).__name__} has no parameter {', '.join(unknown)} "
                                 f"(parameters: {', '.join(self.defaults)})")
        self.params = dict(self.defaults, **params)
        for key, value in self.params.items():
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"optimizer parameter {key}={value!r} must be a number, bool, str or None")
        if self.params.get("lazy_update") is False:
            raise ValueError(f"{type(self).__name__}(lazy_update=False): kvps updates only the rows a row-sparse "
                             f"push names (MXNet's lazy update, its default); a dense push updates every row")

    def spec(self):
        """What travels to the servers (and the schedule of its learning rate, if any)."""
        spec = {"name": self.name, "params": dict(self.params)}
        if self.lr_scheduler is not None:
            spec["lr_scheduler"] = self.lr_scheduler.spec()
        return spec

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        if self.lr_scheduler is not None:
            args += f", lr_scheduler={self.lr_scheduler!r}"
        return f"{type(self).__name__}({args})" if self.defaults else f"Optimizer({self.name!r}, {args})"


# multi_precision: MXNet's flag for a float32 master copy of 16-bit weights, which kvps's servers
# always keep (True or False is taken; fit.py passes it); lazy_update: MXNet's row-sparse update of
# only the rows pushed, which is the only one kvps has (False is refused: it would differ silently).
_COMMON = {"learning_rate": 0.01, "wd": 0.0, "rescale_grad": 1.0, "clip_gradient": None, "multi_precision": True}


class SGD(Optimizer):
    """weight -= lr * (clip(rescale_grad * grad) + wd * weight), with optional (Nesterov) momentum."""
    name = "sgd"
    defaults = dict(_COMMON, momentum=0.0, nesterov=False, lazy_update=True)


class NAG(SGD):
    """SGD with Nesterov momentum (MXNet's NAG)."""
    name = "nag"
    defaults = dict(_COMMON, momentum=0.9, nesterov=True, lazy_update=True)


class Adam(Optimizer):
    name = "adam"
    defaults = dict(_COMMON, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, lazy_update=True)


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


class Test(Optimizer):
    """weight += rescale_grad * grad: MXNet's 'test' optimizer, which its dist kvstore tests
    (tests/nightly/dist_sync_kvstore.py) check sums with."""
    name = "test"
    defaults = dict(_COMMON)


_BUILTIN = {cls.name: cls for cls in (SGD, NAG, Adam, AdamW, AdaGrad, RMSProp, Test)}


def from_spec(spec):
    """The Optimizer a spec() describes (a checkpoint's manifest keeps one)."""
    schedule = spec.get("lr_scheduler")
    return Optimizer(spec["name"], lr_scheduler=None if schedule is None else schedules.from_spec(schedule),
                     **spec["params"])


def create(name, **params):
    """An optimizer by name (MXNet's mx.optimizer.create); unknown names become a generic
    Optimizer for a rule the server operator installed."""
    cls = _BUILTIN.get(name.lower())
    return cls(**params) if cls is not None else Optimizer(name, **params)
