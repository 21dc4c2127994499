"""Learning-rate schedules (kvps/lr_scheduler.py): MXNet 1.9's rates, their description for the
servers, and the servers' update count (MXNet's num_update) on a local kvstore."""
import math

import numpy as np
import pytest

import kvps
from kvps import lr_scheduler as lrs
from kvps.ps.rules import Registry


def _mxnet_factor(step, factor, stop, base, n):
    """MXNet's FactorScheduler as it runs: called at every update count up to n."""
    count, lr = 0, base
    for k in range(1, n + 1):
        while k > count + step:
            count += step
            lr = max(lr * factor, stop)
    return lr


def test_rates_follow_mxnet():
    f = lrs.FactorScheduler(step=3, factor=0.7, stop_factor_lr=0.02, base_lr=0.1)
    assert [f(n) for n in range(1, 30)] == [_mxnet_factor(3, 0.7, 0.02, 0.1, n) for n in range(1, 30)]
    assert f(4) == 0.1 * 0.7 and f(29) == 0.02
    m = lrs.MultiFactorScheduler(step=[2, 5], factor=0.5, base_lr=1.0)
    assert [m(n) for n in range(1, 8)] == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    p = lrs.PolyScheduler(max_update=10, base_lr=0.1, pwr=2, final_lr=0.01, warmup_steps=2)
    assert p(0) == 0.0 and p(1) == pytest.approx(0.05)                    # linear warm-up from 0 to base_lr
    assert p(6) == pytest.approx(0.01 + 0.09 * (1 - 4 / 8) ** 2) and p(10) == p(50) == pytest.approx(0.01)
    c = lrs.CosineScheduler(max_update=20, base_lr=0.2, final_lr=0.0, warmup_steps=4, warmup_begin_lr=0.1,
                            warmup_mode="constant")
    assert c(3) == 0.1 and c(4) == pytest.approx(0.2) and c(12) == pytest.approx(0.1) and c(99) == pytest.approx(0.0)


def test_a_rate_asked_out_of_order_is_the_same():
    f = lrs.FactorScheduler(step=2, factor=0.5, base_lr=1.0)
    assert [f(n) for n in (9, 3, 9, 1, 30)] == [1 / 16, 0.5, 1 / 16, 1.0, 0.5 ** 14]


def test_optimizer_learning_rate_replaces_base_lr_as_in_mxnet():
    sched = lrs.FactorScheduler(step=10, factor=0.5, base_lr=0.3, warmup_steps=4)
    opt = kvps.optimizer.SGD(learning_rate=0.1, lr_scheduler=sched)
    assert sched.base_lr == 0.1 and sched.warmup_final_lr == 0.3       # MXNet keeps the warm-up's end
    assert opt.spec()["lr_scheduler"]["name"] == "factor"
    alone = kvps.optimizer.create("adam", lr_scheduler=lrs.CosineScheduler(100, base_lr=0.02))
    assert alone.params["learning_rate"] == 0.02                      # no learning_rate: the schedule's


@pytest.mark.parametrize("sched", [lrs.FactorScheduler(3, 0.5, base_lr=0.4, warmup_steps=2),
                                   lrs.MultiFactorScheduler([3, 8], 0.1, warmup_steps=1, warmup_mode="constant"),
                                   lrs.PolyScheduler(30, base_lr=0.3, pwr=1.5, final_lr=0.05),
                                   lrs.CosineScheduler(30, base_lr=0.3, warmup_steps=5, warmup_begin_lr=0.1)])
def test_a_spec_makes_the_same_schedule(sched):
    kvps.optimizer.SGD(learning_rate=0.25, lr_scheduler=sched)       # base_lr replaced, as MXNet does
    again = lrs.from_spec(sched.spec())
    assert type(again) is type(sched) and again.spec() == sched.spec()
    assert [again(n) for n in range(40)] == [sched(n) for n in range(40)]


@pytest.mark.parametrize("spec,match", [
    ({"name": "exp", "params": {}}, "no lr_scheduler 'exp'"),
    ({"name": "factor", "params": {"step": 0}}, "step=0 must be an int >= 1"),
    ({"name": "factor", "params": {"step": 2, "factor": "x"}}, "factor='x' is not a finite number"),
    ({"name": "factor", "params": {"step": 2, "factor": float("nan")}}, "is not a finite number"),
    ({"name": "factor", "params": {"step": 2, "bogus": 1}}, "unexpected keyword argument 'bogus'"),
    ({"name": "multifactor", "params": {"step": [5, 3]}}, "increasing list"),
    ({"name": "poly", "params": {"max_update": 10, "pwr": -1}}, "pwr=-1 must be >= 0"),
    ({"name": "cosine", "params": {"max_update": 3, "warmup_steps": 3}}, "must be above warmup_steps"),
    ({"name": "factor", "params": {"step": 2, "warmup_mode": "cubic"}}, "warmup_mode='cubic'"),
    ({"name": "factor"}, "is not {'name': str, 'params': dict}"),
])
def test_a_bad_spec_is_refused_with_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        lrs.from_spec(spec)
    with pytest.raises(ValueError, match=match):        # as a server refuses a worker's SET_OPTIMIZER
        Registry().create({"name": "sgd", "params": {}, "lr_scheduler": spec})


def test_a_schedule_needs_a_learning_rate_and_a_schedule_object():
    with pytest.raises(ValueError, match="must be a kvps.lr_scheduler schedule"):
        kvps.optimizer.SGD(lr_scheduler=lambda n: 0.1)
    with pytest.raises(ValueError, match="has no learning_rate"):
        registry = Registry()

        class NoRate(registry._rules["sgd"]):
            name, defaults = "norate", {"wd": 0.0, "rescale_grad": 1.0, "clip_gradient": None, "momentum": 0.0,
                                        "nesterov": False}
        registry.add(NoRate)
        registry.create({"name": "norate", "params": {}, "lr_scheduler": lrs.FactorScheduler(2).spec()})


def test_the_rate_follows_the_most_updated_key():
    """MXNet's num_update: the most updates the optimizer has applied to any key, counting this one, so a
    key updated for the first time after another was updated 3 times steps at the third update's rate."""
    kv = kvps.create("local")
    kv.set_optimizer(kvps.optimizer.SGD(learning_rate=1.0, lr_scheduler=lrs.MultiFactorScheduler([1, 2, 3], 0.5)))
    kv.init(["a", "b"], [np.zeros(1, np.float32), np.zeros(1, np.float32)])
    out = np.zeros(1, np.float32)
    for _ in range(3):
        kv.push("a", np.ones(1, np.float32))
    kv.pull("a", out=out)
    assert out[0] == -(1.0 + 0.5 + 0.25)
    kv.push("b", np.ones(1, np.float32))
    kv.pull("b", out=out)
    assert out[0] == -0.25


def test_get_updater_runs_the_schedule():
    updater = kvps.optimizer.get_updater(kvps.optimizer.SGD(lr_scheduler=lrs.FactorScheduler(1, 0.5, base_lr=1.0)))
    w = np.zeros(2, np.float32)
    for _ in range(4):
        updater(0, np.ones(2, np.float32), w)
    assert w.tolist() == [-(1 + 0.5 + 0.25 + 0.125)] * 2 and math.isclose(updater._rule.num_update, 4)


def test_an_optimizer_comes_back_from_a_checkpoints_json_with_its_schedule():
    import json
    opt = kvps.optimizer.SGD(learning_rate=0.2, momentum=0.9, lr_scheduler=lrs.MultiFactorScheduler([4, 9], 0.3))
    again = kvps.optimizer.from_spec(json.loads(json.dumps(opt.spec())))
    assert again.spec() == opt.spec() and again.lr_scheduler(10) == opt.lr_scheduler(10) == 0.2 * 0.3 * 0.3
