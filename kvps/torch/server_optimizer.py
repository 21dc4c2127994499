"""torch optimizers translated into kvps optimizers, which the servers run in async mode (MXNet's
formulas; kvps.ps.rules); options the servers cannot run are refused with the way out."""
import torch

import kvps


def _refuse(name, what, instead="use update_on='worker' (workers step locally and push weight deltas)"):
    raise ValueError(f"the servers cannot run {name} with {what}; {instead}")


def _server_optimizer(cls, g):
    """kvps.optimizer for one param group (all numbers as floats)."""
    num = {k: float(v) if torch.is_tensor(v) or type(v) in (int, float) else v for k, v in g.items() if k != "params"}
    name, lr, wd = cls.__name__, num["lr"], num.get("weight_decay", 0.0)
    if g.get("maximize"):
        _refuse(name, "maximize=True")
    if issubclass(cls, torch.optim.SGD):
        if num["momentum"] and num["dampening"]:
            _refuse(name, f"dampening={num['dampening']} (MXNet's momentum has none)")
        return kvps.optimizer.SGD(learning_rate=lr, momentum=num["momentum"], nesterov=bool(g["nesterov"]), wd=wd)
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        if g.get("amsgrad"):
            _refuse(name, "amsgrad=True")
        beta1, beta2 = (float(b) for b in g["betas"])
        if issubclass(cls, torch.optim.AdamW) or g.get("decoupled_weight_decay"):
            # torch decays by lr*wd*w; MXNet's adamw by eta*wd*w: fold lr into wd, eta = 1
            return kvps.optimizer.AdamW(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=num["eps"],
                                        wd=lr * wd, eta=1.0)
        return kvps.optimizer.Adam(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=num["eps"], wd=wd)
    if issubclass(cls, torch.optim.Adagrad):
        if num["lr_decay"] or num["initial_accumulator_value"]:
            _refuse(name, f"lr_decay={num['lr_decay']} or initial_accumulator_value="
                          f"{num['initial_accumulator_value']} (MXNet's AdaGrad has neither)")
        # MXNet adds epsilon inside the square root, torch outside: eps**2 agrees where it matters most
        return kvps.optimizer.AdaGrad(learning_rate=lr, epsilon=num["eps"] ** 2, wd=wd)
    if issubclass(cls, torch.optim.RMSprop):
        if g.get("centered") or num["momentum"]:
            _refuse(name, "centered=True or momentum (kvps's RMSProp is MXNet's plain one)")
        return kvps.optimizer.RMSProp(learning_rate=lr, gamma1=num["alpha"], epsilon=num["eps"] ** 2, wd=wd)
    _refuse(name, "its update rule", "the servers know SGD, Adam, AdamW, Adagrad and RMSprop; "
                                     "use update_on='worker' (workers step locally and push weight deltas)")


def server_optimizer(optimizer):
    """The kvps.optimizer that applies, on the servers, what the torch `optimizer` does locally
    (docs/torch.md says which match torch exactly). Raises ValueError for optimizers and options
    the servers cannot run, and for param groups that differ (the servers run one rule)."""
    rules = [_server_optimizer(type(optimizer), g) for g in optimizer.param_groups]
    for i, rule in enumerate(rules[1:], 1):
        if rule.spec() != rules[0].spec():
            raise ValueError(f"param groups 0 and {i} have different hyperparameters ({rules[0]} and {rule}); "
                             f"the servers run one rule for all keys: use update_on='worker'")
    return rules[0]
