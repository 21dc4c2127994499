"""Server-side update rules and the registry a server looks them up in.

Words: an *optimizer* is what a worker names (kvps.optimizer: a name and numbers); a *rule* is the
code a server runs for it (UpdateRule); a RuleState applies one rule to every key, with each key's
state. A worker names an optimizer and its parameters; the server builds the rule
from its own registry, so only code the server's operator installed ever runs.
An operator adds a rule with a plugin module passed as `kvps server --plugin MOD`;
the module defines `kvps_register(registry)` and calls `registry.add(MyRule)`:

    class Scaled(UpdateRule):
        name = "scaled"
        defaults = {"learning_rate": 0.1}
        def apply(self, weight, grad, state, count):
            weight -= self.params["learning_rate"] * grad

The built-in rules call the fused kernels of kvps.kernels on float32 weights.
float16 and bfloat16 keys keep a float32 master copy (MXNet's multi_precision);
float64 keys run the kernels' numpy reference at float64.
"""
import importlib
import math

import numpy as np

from kvps import kernels, lr_scheduler
from kvps.errors import ConfigError, KVValueError
from kvps.optimizer import SGD, NAG, Adam, AdamW, AdaGrad, RMSProp, Test

FLOATS = {np.dtype(np.float32), np.dtype(np.float64)}


class UpdateRule:
    """One optimizer: `apply` updates weight in place from grad and the rule's state."""

    name = None
    defaults = {}
    state_count = 0          # float32 arrays of the weight's shape kept per key

    def __init__(self, params):
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(f"optimizer {self.name!r} has no parameter {', '.join(unknown)} "
                             f"(parameters: {', '.join(self.defaults)})")
        self.params = dict(self.defaults, **params)
        for key, value in self.params.items():
            if key != "clip_gradient" and isinstance(self.defaults.get(key), float) and \
                    not isinstance(value, (int, float)):
                raise ValueError(f"optimizer {self.name!r} parameter {key}={value!r} is not a number")
        clip = self.params.get("clip_gradient")
        if clip is not None and (not isinstance(clip, (int, float)) or clip < 0):
            raise ValueError(f"optimizer {self.name!r} clip_gradient={clip!r} must be None or >= 0")

    def create_state(self, weight):
        return [np.zeros_like(weight) for _ in range(self.state_count)]

    def apply(self, weight, grad, state, count):
        raise NotImplementedError

    def common(self):
        p = self.params
        return {"wd": p["wd"], "rescale_grad": p["rescale_grad"], "clip_gradient": p["clip_gradient"]}


def _ops(weight):
    """The kernel module for a weight: fused kernels at float32, the reference otherwise."""
    return kernels if weight.dtype == np.float32 else kernels.reference


class SGDRule(UpdateRule):
    name, defaults = SGD.name, SGD.defaults

    def create_state(self, weight):
        return [np.zeros_like(weight)] if self.params["momentum"] else [None]

    def apply(self, weight, grad, state, count):
        p = self.params
        _ops(weight).sgd_update(weight, grad, state[0], lr=p["learning_rate"], momentum=p["momentum"],
                                nesterov=bool(p["nesterov"]), **self.common())


class NAGRule(SGDRule):
    name, defaults = NAG.name, NAG.defaults


class AdamRule(UpdateRule):
    name, defaults, state_count = Adam.name, Adam.defaults, 2

    def moments(self, count):
        """Step arguments shared by Adam and AdamW; MXNet folds the bias corrections into lr."""
        p = self.params
        lr = p["learning_rate"] * math.sqrt(1 - p["beta2"] ** count) / (1 - p["beta1"] ** count)
        return dict(lr=lr, beta1=p["beta1"], beta2=p["beta2"], epsilon=p["epsilon"], **self.common())

    def apply(self, weight, grad, state, count):
        _ops(weight).adam_update(weight, grad, state[0], state[1], **self.moments(count))


class AdamWRule(AdamRule):
    name, defaults = AdamW.name, AdamW.defaults

    def apply(self, weight, grad, state, count):
        _ops(weight).adamw_update(weight, grad, state[0], state[1], eta=self.params["eta"], **self.moments(count))


class AdaGradRule(UpdateRule):
    name, defaults, state_count = AdaGrad.name, AdaGrad.defaults, 1

    def apply(self, weight, grad, state, count):
        p = self.params
        _ops(weight).adagrad_update(weight, grad, state[0], lr=p["learning_rate"], epsilon=p["epsilon"],
                                    **self.common())


class RMSPropRule(UpdateRule):
    name, defaults, state_count = RMSProp.name, RMSProp.defaults, 1

    def apply(self, weight, grad, state, count):
        p = self.params
        _ops(weight).rmsprop_update(weight, grad, state[0], lr=p["learning_rate"], gamma1=p["gamma1"],
                                    epsilon=p["epsilon"], **self.common())


class TestRule(UpdateRule):
    """MXNet's: the gradient, scaled, is added (learning rate, wd and clipping are not used)."""
    name, defaults = Test.name, Test.defaults

    def apply(self, weight, grad, state, count):
        _ops(weight).axpy(weight, self.params["rescale_grad"], grad.astype(weight.dtype, copy=False))


BUILTIN = (SGDRule, NAGRule, AdamRule, AdamWRule, AdaGradRule, RMSPropRule, TestRule)


class Registry:
    """The update rules one server knows: the built-ins plus its operator's plugins."""

    def __init__(self):
        self._rules = {rule.name: rule for rule in BUILTIN}

    def add(self, rule):
        if not (isinstance(rule, type) and issubclass(rule, UpdateRule) and isinstance(rule.name, str)):
            raise TypeError(f"{rule!r} is not an UpdateRule subclass with a name")
        self._rules[rule.name] = rule

    def names(self):
        return sorted(self._rules)

    def load_plugin(self, module_name):
        """Import an operator's module and let it register its rules."""
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"--plugin {module_name}: cannot import it ({exc})") from None
        register = getattr(module, "kvps_register", None)
        if not callable(register):
            raise ConfigError(f"--plugin {module_name}: the module has no kvps_register(registry) function")
        register(self)

    def create(self, spec):
        """A RuleState for a worker's {"name", "params"}; raises ValueError naming what is wrong."""
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                not isinstance(spec.get("params", {}), dict):
            raise ValueError(f"optimizer spec {spec!r} is not {{'name': str, 'params': dict}}")
        rule = self._rules.get(spec["name"].lower())
        if rule is None:
            raise ValueError(f"this server has no optimizer {spec['name']!r} (it has: {', '.join(self.names())}; "
                             f"an operator adds more with --plugin)")
        made = rule(spec.get("params", {}))
        schedule = spec.get("lr_scheduler")
        if schedule is not None and "learning_rate" not in made.params:
            raise ValueError(f"optimizer {spec['name']!r} has no learning_rate for an lr_scheduler to set")
        return RuleState(made, None if schedule is None else lr_scheduler.from_spec(schedule))


class RuleState:
    """Applies one rule to every key of a server, keeping each key's state and step count. With a
    schedule (kvps.lr_scheduler) the rule's learning_rate is the schedule's at num_update, the most
    updates applied to any key here, counting the one being applied (MXNet's num_update)."""

    def __init__(self, rule, schedule=None):
        self.rule = rule
        self.schedule = schedule
        self.num_update = 0
        self._state = {}        # slot id -> [master float32 weight or None, count, state arrays]

    def _entry(self, slot_id, weight):
        if weight.dtype.kind not in "fV" and weight.dtype.name != "bfloat16":
            raise ValueError(f"key {slot_id[0]!r} is {weight.dtype}: an optimizer needs a floating-point key")
        entry = self._state.get(slot_id)
        if entry is None:
            master = None if weight.dtype in FLOATS else weight.astype(np.float32)
            entry = self._state[slot_id] = [master, 0, self.rule.create_state(master if master is not None
                                                                               else weight)]
        entry[1] += 1
        if self.schedule is not None:
            self.num_update = max(self.num_update, entry[1])
            self.rule.params["learning_rate"] = self.schedule(self.num_update)
        return entry

    def __call__(self, slot_id, weight, grad):
        """weight <- rule(weight, grad), in place."""
        master, count, state = self._entry(slot_id, weight)
        if master is None:
            if grad.dtype != weight.dtype:
                grad = grad.astype(weight.dtype)
            self.rule.apply(weight, grad, state, count)
        else:
            self.rule.apply(master, grad, state, count)
            kernels.cast(master.reshape(-1), weight.reshape(-1))

    def update_rows(self, slot_id, weight, rows, grad):
        """The rule on rows `rows` of weight only, with grad holding those rows (MXNet's lazy
        update): the other rows, and their state, stay as they are."""
        master, count, state = self._entry(slot_id, weight)
        full = weight if master is None else master
        sub = np.ascontiguousarray(full[rows])
        sub_state = [None if s is None else np.ascontiguousarray(s[rows]) for s in state]
        self.rule.apply(sub, grad.astype(sub.dtype) if grad.dtype != sub.dtype else grad, sub_state, count)
        full[rows] = sub
        for s, part in zip(state, sub_state):
            if s is not None:
                s[rows] = part
        if master is not None:
            low = np.empty(sub.shape, weight.dtype)
            kernels.cast(sub.reshape(-1), low.reshape(-1))
            weight[rows] = low

    # ---- checkpoints (kvps/ps/store.py exports and restores through these) ----
    def export(self, slot_id, copy=True):
        """A key's (master weight or None, step count, state arrays), copies unless `copy` is False,
        or None before its first update."""
        entry = self._state.get(slot_id)
        if entry is None:
            return None
        master, count, state = entry
        dup = (lambda a: a.copy()) if copy else (lambda a: a)
        return (None if master is None else dup(master), count, [None if s is None else dup(s) for s in state])

    def restore_all(self, states, source):
        """Take saved state {slot id: (master, count, state arrays) or None}; `source` is (checkpoint path,
        optimizer name that saved it). Checks everything first (KVValueError naming the key, the
        checkpoint and what differs), then replaces this rule's state for those keys."""
        path, saved_name = source
        if saved_name is not None and saved_name != self.rule.name:
            raise KVValueError(f"checkpoint {path} holds the state of optimizer {saved_name!r}; this job's "
                               f"optimizer is {self.rule.name!r} (set the one that saved it, or load the "
                               f"weights only: kv.load(path, optimizer_states=False))")
        for slot_id, saved in states.items():
            if saved is None:
                continue
            master, count, state = saved
            like = master if master is not None else next((s for s in state if s is not None),
                                                          np.zeros(0, np.float32))
            template = self.rule.create_state(like)
            kinds = [s is None for s in template]
            if len(state) != len(template) or [s is None for s in state] != kinds:
                raise KVValueError(f"checkpoint {path}: key {slot_id[0]!r} part {slot_id[1]} holds "
                                   f"{sum(s is not None for s in state)} state arrays of {self.rule.name!r}; "
                                   f"this job's {self.rule.name} keeps {kinds.count(False)} "
                                   f"(its parameters, e.g. momentum, differ)")
        for slot_id, saved in states.items():
            if saved is None:            # saved before its first update, or the weights only: start afresh
                self._state.pop(slot_id, None)
            else:
                master, count, state = saved
                self._state[slot_id] = [master, int(count), list(state)]
        self.num_update = max((entry[1] for entry in self._state.values()), default=0)
