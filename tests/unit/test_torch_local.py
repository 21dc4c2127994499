"""kvps.torch in process: DistributedOptimizer on the local kvstore, gradient buckets (DDP's
grouping, unused parameters), broadcasts, the store's join bookkeeping and the server-optimizer
translation."""

import numpy as np
import pytest
import torch

import kvps
import kvps.torch as kt
from kvps.errors import KVValueError
from kvps.ps.store import Store

# Shared by the worker scripts and the single-process references in this file.
COMMON = r'''
import json, os, sys
import torch
import torch.nn.functional as F
import kvps, kvps.torch as kt
torch.set_num_threads(1)
_g = torch.Generator().manual_seed(0)
X = torch.randn(64, 8, generator=_g)
Y = (X[:, :4].sum(1) > 0).long() + 2 * (X[:, 4:].sum(1) > 0).long()
STEPS, LR = 12, 0.1

def make_model(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

class Branchy(torch.nn.Module):
    """make_model's network plus a layer only some batches use and one nothing uses."""
    def __init__(self, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.unused = torch.nn.Linear(3, 3)
        self.fc1, self.extra, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(8, 4), torch.nn.Linear(16, 4)

    def forward(self, x, use_extra):
        out = self.fc2(F.relu(self.fc1(x)))
        return out + self.extra(x) if use_extra else out

# its parameters' gradients as DDP buckets them with bucket_bytes=280 (the bytes in brackets)
BRANCHY_BUCKETS = [["fc2.bias", "fc2.weight"],                      # [16 + 256]
                   ["extra.bias", "extra.weight", "fc1.bias"],      # [16 + 128 + 64]
                   ["fc1.weight"],                                  # [512]: the next one is past 280
                   ["unused.bias", "unused.weight"]]                # [12 + 36]

def batch(step):
    i = step % 2 * 32
    return X[i:i + 32], Y[i:i + 32]

def full_loss(model):
    with torch.no_grad():
        return F.cross_entropy(model(X), Y).item()

def train(model, opt, steps, rank, workers, passes=1):
    """Each worker takes every W-th sample of the step's batch, in `passes` backward passes."""
    losses = []
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank::workers], y[rank::workers]
        opt.zero_grad()
        for xc, yc in zip(x.chunk(passes), y.chunk(passes)):
            (F.cross_entropy(model(xc), yc) / passes).backward()
        opt.step()
        losses.append(full_loss(model))
    return losses

def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()]).tolist()
'''
ns = {}
exec(COMMON, ns)


def reference(steps=None):
    model = ns["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=ns["LR"], momentum=0.9)
    return ns["train"](model, opt, steps or ns["STEPS"], 0, 1)


def test_the_module_imports_the_real_torch():
    import sys
    assert kt.torch is sys.modules["torch"] and kvps.torch is kt


@pytest.mark.parametrize("passes", [1, 2])
def test_sync_on_one_worker_is_plain_torch(passes):
    model = ns["make_model"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=ns["LR"], momentum=0.9),
                                  model.named_parameters(), backward_passes_per_step=passes,
                                  kvstore=kvps.create("local"))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    losses = ns["train"](model, opt, ns["STEPS"], 0, 1, passes)
    if passes == 1:
        assert losses == reference()                       # the very same arithmetic
    else:                                                  # two half-batch means summed: rounding differs
        np.testing.assert_allclose(losses, reference(), rtol=1e-5)


def test_misuse_is_reported():
    model = ns["make_model"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  kvstore=kvps.create("local"))
    x, y = ns["batch"](0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad.. while gradients are being reduced"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="after its gradient was sent"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="add_param_group on a DistributedOptimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0,
                                kvstore=kvps.create("local"))
    with pytest.raises(ValueError, match="not in named_parameters"):
        kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters())[:1],
                                kvstore=kvps.create("local"))
    with pytest.raises(ValueError, match="cannot run on a local kvstore"):
        kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mode="async", update_on="worker",
                                kvstore=kvps.create("local"))
    with pytest.raises(ValueError, match="staleness=1: BytePS's pipelined steps are not supported"):
        kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), staleness=1,
                                kvstore=kvps.create("local"))
    with pytest.raises(ValueError, match="compress in DistributedOptimizer"):
        kt.push_pull(torch.ones(2), compression=kt.Compression.fp16)
    with pytest.raises(ValueError, match="bps.declare takes a tensor's name"):
        kt.declare("")


def _amp_weights(naive):
    """Weights after 4 steps with torch's GradScaler: `naive` calls scaler.step(opt) straight after
    backward(), else the Horovod way (synchronize, unscale_, clip, step inside skip_synchronize)."""
    model = ns["make_model"]()
    kv = kvps.create("local")
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kvstore=kv)
    calls = []
    pushpull = kv.pushpull
    kv.pushpull = lambda *a, **k: calls.append(1) or pushpull(*a, **k)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        x, y = ns["batch"](step)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        if naive:
            scaler.step(opt)        # its unscale_ reads the gradients through opt: reduced first
        else:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], len(calls)


def test_grad_scaler_step_right_after_backward_unscales_the_reduced_gradients():
    naive, naive_calls = _amp_weights(True)
    horovod, horovod_calls = _amp_weights(False)
    assert all(torch.equal(a, b) for a, b in zip(naive, horovod)) and naive_calls == horovod_calls


def test_a_gradient_changed_while_being_reduced_is_an_error_and_synchronize_first_works():
    model = ns["make_model"]()
    kv = kvps.create("local")
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kvstore=kv)
    x, y = ns["batch"](0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)       # Horovod's docs: synchronize() first
    with pytest.raises(RuntimeError, match=r"gradients of .* were changed in place while being reduced"):
        opt.step()
    opt.zero_grad()
    calls = []
    pushpull = kv.pushpull
    kv.pushpull = lambda *a, **k: calls.append(1) or pushpull(*a, **k)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()                      # without skip_synchronize: the gradients are not reduced again
    assert len(calls) == len(opt.buckets) and norm <= 0.0100001
    assert all(torch.allclose(b - 0.1 * p.grad, p.detach()) for b, p in zip(before, model.parameters()))


def test_lr_scheduler_drives_the_wrapped_optimizer():
    model = ns["make_model"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  kvstore=kvps.create("local"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ns["train"](model, opt, 1, 0, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_buckets_group_gradients_as_ddp_does():
    t = lambda n, dtype=torch.float32: torch.zeros(n, dtype=dtype)     # noqa: E731
    params = [t(10), t(10), t(5, torch.float64), t(100), t(2), t(2), t(2)]   # 40 40 40 400 8 8 8 bytes
    # reverse order; a new bucket at the dtype change, past the limit, and for a tensor bigger than it
    assert kt.buckets(params, limit=100) == [[6, 5, 4], [3], [2], [1, 0]]
    assert kt.buckets(params, limit=100, first=16) == [[6, 5], [4], [3], [2], [1, 0]]   # DDP's small first bucket
    assert kt.buckets(params, limit=0) == [[i] for i in reversed(range(7))]
    assert kt.buckets(params, limit=1 << 30) == [[6, 5, 4, 3], [2], [1, 0]]
    model = ns["Branchy"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  bucket_bytes=280, kvstore=kvps.create("local"))
    assert opt.buckets == ns["BRANCHY_BUCKETS"]
    with pytest.raises(ValueError, match="bucket_bytes=-1"):
        kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=-1,
                                kvstore=kvps.create("local"))


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
@pytest.mark.parametrize("bucket_bytes", [0, 280, kt.BUCKET_BYTES], ids=["per-parameter", "4-buckets", "1-bucket"])
def test_unused_parameters_go_as_zeros_at_step(mode, bucket_bytes):
    F = torch.nn.functional
    plain, model = ns["Branchy"](), ns["Branchy"]()
    # no momentum: torch skips a parameter without a gradient, kvps.torch steps it with zeros (docs/torch.md)
    ref = torch.optim.SGD(plain.parameters(), lr=ns["LR"])
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=ns["LR"]), model.named_parameters(),
                                  mode=mode, bucket_bytes=bucket_bytes, kvstore=kvps.create("local"))
    for step in range(4):
        x, y = ns["batch"](step)
        for net, o in ((plain, ref), (model, opt)):
            o.zero_grad()
            F.cross_entropy(net(x, use_extra=step % 2 == 0), y).backward()
            o.step()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name                     # zeros for a missing gradient change nothing
    assert torch.equal(model.unused.weight.grad, torch.zeros(3, 3))


@pytest.mark.parametrize("mode, sent", [("sync", [True, False, True, False]),         # each when complete
                                        ("allreduce", [True, False, False, False])])  # and in bucket order
def test_buckets_go_during_backward_when_complete(mode, sent):
    model = ns["Branchy"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), mode=mode,
                                  bucket_bytes=280, kvstore=kvps.create("local"))
    x, y = ns["batch"](0)
    torch.nn.functional.cross_entropy(model(x, use_extra=False), y).backward()
    # bucket 1 waits for `extra` and bucket 3 for `unused` (until step()); on the ring bucket 2 waits for 1
    assert [h is not None for h in opt._handles] == sent
    opt.step()
    assert opt._handles == [None] * 4


# (torch optimizer, how close the servers' MXNet formulas come in 12 steps): docs/torch.md
SERVER_RULES = [
    (lambda p: torch.optim.SGD(p, lr=0.1), 1e-6),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3), 1e-6),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), 1e-6),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), 1e-5),
    (lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3), 3e-3),   # eps sits elsewhere
    (lambda p: torch.optim.AdamW(p, lr=0.01), 3e-3),
    (lambda p: torch.optim.RMSprop(p, lr=0.01), 3e-3),
]


@pytest.mark.parametrize("make, tol", SERVER_RULES,
                         ids=["sgd", "sgd-momentum-wd", "nesterov", "adagrad", "adam", "adamw", "rmsprop"])
def test_server_optimizer_follows_torch(make, tol):
    torch_model, server_model = ns["make_model"](), ns["make_model"]()
    ns["train"](torch_model, make(torch_model.parameters()), ns["STEPS"], 0, 1)
    # the local kvstore runs the rule as a server does (a round of one worker: every push applied)
    opt = kt.DistributedOptimizer(make(server_model.parameters()), server_model.named_parameters(), mode="async",
                                  kvstore=kvps.create("local"))
    ns["train"](server_model, opt, ns["STEPS"], 0, 1)
    for (name, a), b in zip(torch_model.named_parameters(), server_model.parameters()):
        assert torch.allclose(a, b, atol=tol, rtol=0), (name, (a - b).abs().max().item())


@pytest.mark.parametrize("make, match", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5), "dampening=0.5"),
    (lambda p: torch.optim.SGD(p, lr=0.1, maximize=True), "maximize"),
    (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.RMSprop(p, centered=True), "centered"),
    (lambda p: torch.optim.Adagrad(p, lr_decay=0.1), "lr_decay"),
    (lambda p: torch.optim.Adamax(p), "update rule"),
    (lambda p: torch.optim.SGD([{"params": p[:2]}, {"params": p[2:], "weight_decay": 0.1}], lr=0.1),
     "param groups 0 and 1"),
])
def test_server_optimizer_refuses_what_it_cannot_run(make, match):
    opt = make(list(ns["make_model"]().parameters()))
    with pytest.raises(ValueError, match=match):
        kt.server_optimizer(opt)


def test_async_server_optimizer_refuses_a_changed_lr():
    model = ns["make_model"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  mode="async", kvstore=kvps.create("local"))
    ns["train"](model, opt, 1, 0, 1)
    opt.param_groups[0]["lr"] = 0.01
    with pytest.raises(ValueError, match="update_on='worker'"):
        ns["train"](model, opt, 1, 0, 1)


def test_broadcast_keeps_every_dtype_bit_exact():
    kv = kvps.create("local")
    values = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "i64": torch.tensor(7), "bool": torch.tensor([1, 0, 1]) > 0,
              "i16": torch.arange(3, dtype=torch.int16), "f64": torch.randn(4, dtype=torch.float64),
              "nc": torch.randn(4, 3).t(), "nan": torch.tensor([float("nan"), -0.0])}
    before = {k: v.clone() for k, v in values.items()}
    kt.broadcast_parameters(values, kvstore=kv)

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)
    for k, v in values.items():
        assert v.dtype == before[k].dtype and torch.equal(raw(v), raw(before[k])), k


def _acks(log, name):
    return lambda result: log.append((name, result))


def test_store_join_counts_joined_workers_as_zeros():
    store, log = Store(num_workers=3, mode="sync"), []
    store.init(0, "w", 0, np.float32, (2,), np.zeros(2, np.float32), _acks(log, "init"))
    store.push(0, "w", 0, np.full(2, 1, np.float32), _acks(log, "push0"))
    store.push(1, "w", 0, np.full(2, 2, np.float32), _acks(log, "push1"))
    assert [n for n, _ in log] == ["init"]
    store.worker_joined(2)                                  # completes the open round at once
    assert [n for n, _ in log] == ["init", "push0", "push1"]
    store.pull(2, "w", 0, _acks(log, "pull2"))              # a joined worker's pull never waits
    assert log[-1][0] == "pull2" and list(log[-1][1]) == [3, 3]
    store.push(0, "w", 0, np.full(2, 5, np.float32), _acks(log, "push0b"))
    store.pull(0, "w", 0, _acks(log, "pull0"))             # waits for W1's push
    assert log[-1][0] == "pull2"
    store.push(1, "w", 0, np.full(2, 6, np.float32), _acks(log, "push1b"))
    assert [n for n, _ in log[-3:]] == ["push0b", "push1b", "pull0"] and list(log[-1][1]) == [11, 11]
    with pytest.raises(KVValueError, match="W2 pushed key 'w' after join"):
        store.push(2, "w", 0, np.zeros(2, np.float32), _acks(log, "bad"))
    store.worker_joined(0)
    store.worker_joined(1)                                  # everyone has joined: all are back
    assert store.joined == set() and store.stats["last_joined"] == 1
    for w in range(3):
        store.push(w, "w", 0, np.full(2, w, np.float32), _acks(log, f"epoch2.{w}"))
        store.pull(w, "w", 0, _acks(log, f"pull.{w}"))
    assert [n for n, _ in log[-6:]] == ["epoch2.0", "epoch2.1", "epoch2.2", "pull.0", "pull.1", "pull.2"]
    assert all(list(v) == [3, 3] for _, v in log[-3:])


# ---- KVPS_TIMELINE: each bucket's hook-to-sync time (the job's own test: tests/cluster/test_timeline_job.py) ----
def test_bucket_timeline_costs_an_attribute_test_when_off():
    import types

    from kvps.torch.session import _telemetry
    model, kv = ns["make_model"](), kvps.create("local")
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kvstore=kv)
    assert opt._telemetry is None and not hasattr(opt, "_times")        # the hooks test `_telemetry` only
    kv._node = types.SimpleNamespace(telemetry=types.SimpleNamespace(timeline=None))    # metrics on, timeline off
    assert _telemetry(kv) is None


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_bucket_timeline_events(tmp_path, mode):
    import json
    import types

    from kvps.metrics.telemetry import Telemetry
    kv = kvps.create("local")
    telemetry = Telemetry(types.SimpleNamespace(metrics_port=None, timeline=str(tmp_path)), "worker", "127.0.0.1")
    kv._node = types.SimpleNamespace(telemetry=telemetry)       # as a distributed kvstore's node carries it
    model = ns["Branchy"]()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), mode=mode,
                                  bucket_bytes=280, kvstore=kv)
    for step in range(2):
        x, y = ns["batch"](step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x, use_extra=False), y).backward()
        opt.step()
    telemetry.close()
    (path,) = tmp_path.iterdir()
    events = [e for e in map(json.loads, path.read_text().splitlines()) if e.get("cat") == "torch"]
    assert [e["name"] for e in events] == [f"bucket {b}" for _ in range(2) for b in range(4)]
    names = dict(model.named_parameters())
    for e in events:
        b, args = int(e["name"].split()[1]), e["args"]
        members = opt.buckets[b]
        assert e["ph"] == "X" and e["dur"] >= 0 and isinstance(e["ts"], int) and 0 <= args["handed_us"] <= e["dur"]
        assert args["bucket"] == b and args["nkeys"] == len(members)
        assert args["keys"] == [opt._keys[opt._names.index(n)] for n in members]
        assert args["bytes"] == sum(names[n].numel() * 4 for n in members)
    # buckets 1 and 3 miss a gradient (`extra`, `unused`) and go from step(): handed as they become ready
    assert events[1]["args"]["handed_us"] == 0 and events[3]["args"]["handed_us"] == 0


def test_a_horovod_script_run_without_a_launcher_is_one_worker():
    """hvd.init() in a script started with plain `python` (no scheduler address): Horovod runs it as
    the only worker, so kvps does too, on a local kvstore; an explicit mode still needs a job."""
    import json
    import os
    import subprocess
    import sys
    script = COMMON + r'''
import kvps.torch as hvd
hvd.init()
model = make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
losses = train(model, opt, STEPS, hvd.rank(), hvd.size())
mean = hvd.allreduce(torch.tensor([2.0, 4.0]), name="metric").tolist()
try:
    kt.Session().kvstore(mode="sync")
    refused = None
except kvps.ConfigError as exc:
    refused = str(exc)
print(json.dumps({"size": hvd.size(), "rank": hvd.rank(), "type": kt.init().type, "losses": losses,
                  "mean": mean, "refused": refused}))
'''
    env = {k: v for k, v in os.environ.items() if k not in ("KVPS_SCHEDULER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert (got["size"], got["rank"], got["type"]) == (1, 0, "local")
    assert got["losses"] == reference() and got["mean"] == [2.0, 4.0]
    assert "no scheduler address" in got["refused"]


def test_elastic_state_commits_and_restores():
    """hvd.elastic.TorchState: commit() keeps the model, the optimizer state and the values; restore()
    goes back to them (Horovod's contract for a reset)."""
    model = ns["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = kt.elastic.TorchState(model, opt, epoch=0, batch=0)
    x, y = ns["batch"](0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state.epoch, state.batch = 1, 7
    state.commit()
    kept = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.batch) == (1, 7)
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.on_reset()
    assert calls == [1]
