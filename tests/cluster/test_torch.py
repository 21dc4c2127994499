"""kvps.torch on real jobs: DistributedOptimizer in every mode against single-process training,
one collective per bucket, async training, and join() with uneven data."""

import numpy as np
import pytest
import torch

import kvps
import kvps.torch as kt

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


def by_stage(lines):
    return {line["stage"]: line for line in lines}


SYNC = COMMON + r'''
mode = os.environ["MODE"]
kv = kt.init(mode)
r, W = kv.rank, kv.num_workers
out = lambda **kw: print(json.dumps(kw), flush=True)

# broadcast_parameters: different starting weights on every rank, rank 0's afterwards
model = make_model(seed=1 if r == 0 else 100 + r)
BUCKET = int(os.environ["BUCKET_BYTES"])
opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model.named_parameters(),
                              mode=mode, bucket_bytes=BUCKET)
out(stage="buckets", buckets=opt.buckets)
kt.broadcast_parameters(model.state_dict(), root_rank=0)
out(stage="broadcast", weights=flat(model))
extra = {"bf16": torch.full((3, 2), r + 0.5).to(torch.bfloat16), "steps": torch.tensor(10 + r),
         "mask": torch.tensor([r == 1, True]), "nc": torch.full((4, 3), float(r)).t()}
kt.broadcast_parameters(extra, root_rank=1)               # any root
out(stage="broadcast_root1", extra={k: v.float().tolist() for k, v in extra.items()})

out(stage="sync", losses=train(model, opt, STEPS, r, W))
model2 = make_model()
opt2 = kt.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=LR, momentum=0.9),
                               model2.named_parameters(), mode=mode, backward_passes_per_step=2, bucket_bytes=BUCKET)
out(stage="passes2", losses=train(model2, opt2, STEPS, r, W, passes=2))

# broadcast_optimizer_state: rank 0 has stepped Adam (and a new lr), rank 1 has not
small = make_model()
adam = torch.optim.Adam(small.parameters(), lr=0.01)
if r == 0:
    for step in range(3):
        adam.zero_grad(); F.cross_entropy(small(X), Y).backward(); adam.step()
    adam.param_groups[0]["lr"] = 0.0123
kt.broadcast_optimizer_state(adam, root_rank=0)
state = adam.state_dict()
out(stage="optimizer_state", lr=state["param_groups"][0]["lr"], betas=list(state["param_groups"][0]["betas"]),
    state={str(i): {k: v.double().sum().item() for k, v in s.items()} for i, s in state["state"].items()})

if os.environ.get("COMPRESSION"):
    model3 = make_model()
    opt3 = kt.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=LR, momentum=0.9),
                                   model3.named_parameters(), mode=mode, compression=os.environ["COMPRESSION"],
                                   bucket_bytes=BUCKET)
    out(stage="compressed", losses=train(model3, opt3, STEPS, r, W))
'''


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_sync_modes_match_single_process_training(cluster, mode):
    c = cluster(2, 1 if mode == "sync" else 0)
    results = [by_stage(lines) for lines in
               c.run_workers(SYNC, timeout=90, env={"MODE": mode, "COMPRESSION": "fp16" if mode == "sync" else "",
                                                    "BUCKET_BYTES": "300"})]
    ref = reference()
    start = ns["make_model"]()
    for rank, stages in enumerate(results):
        # three buckets: each a multi-key pushpull (servers) or a fused collective (ring)
        assert stages["buckets"]["buckets"] == [["2.bias", "2.weight"], ["0.bias"], ["0.weight"]]
        assert stages["broadcast"]["weights"] == ns["flat"](start), rank
        assert stages["broadcast_root1"]["extra"] == {"bf16": [[1.5, 1.5]] * 3, "steps": 11.0, "mask": [1.0, 1.0],
                                                      "nc": [[1.0] * 4] * 3}, rank
        # W halves averaged are the full batch: the same training, up to float rounding
        np.testing.assert_allclose(stages["sync"]["losses"], ref, rtol=1e-4, err_msg=f"rank {rank}")
        np.testing.assert_allclose(stages["passes2"]["losses"], ref, rtol=1e-4, err_msg=f"rank {rank}")
        assert stages["optimizer_state"] == results[0]["optimizer_state"]
        if mode == "sync":
            np.testing.assert_allclose(stages["compressed"]["losses"], ref, rtol=2e-2, err_msg=f"rank {rank}")
    state = results[1]["optimizer_state"]
    assert state["lr"] == 0.0123 and state["betas"] == [0.9, 0.999]
    assert len(state["state"]) == 4 and all(s["step"] == 3.0 for s in state["state"].values())
    assert c.wait_daemons() == [0] * (1 + c.servers)


BUCKETS = COMMON + r'''
kv = kt.init("allreduce")
r, W = kv.rank, kv.num_workers
result = {}
for bucket_bytes in (280, 0):
    model = Branchy()
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                  model.named_parameters(), mode="allreduce", bucket_bytes=bucket_bytes)
    collectives = []
    for step in range(6):
        x, y = batch(step)
        opt.zero_grad()
        before = kv._ring._next                           # the ring numbers its collectives
        # only rank 0 uses `extra` (rank 1 sends zeros for it at step()); nobody uses `unused`
        F.cross_entropy(model(x[r::W], use_extra=r == 0), y[r::W]).backward()
        opt.step()
        collectives.append(kv._ring._next - before)
    result[bucket_bytes] = {"buckets": opt.buckets, "collectives": collectives, "weights": flat(model)}
print(json.dumps(result), flush=True)
'''


def _branchy_reference(steps=6):
    """One process: rank 0's half-batch through `extra`, rank 1's without, the two means averaged."""
    F = torch.nn.functional
    model = ns["Branchy"]()
    opt = torch.optim.SGD(model.parameters(), lr=ns["LR"], momentum=0.9)
    for step in range(steps):
        x, y = ns["batch"](step)
        opt.zero_grad()
        sum(F.cross_entropy(model(x[r::2], use_extra=r == 0), y[r::2]) for r in range(2)).div(2).backward()
        opt.step()
    return ns["flat"](model)


def test_allreduce_sends_one_collective_per_bucket(cluster):
    c = cluster(2, 0)
    results = [lines[0] for lines in c.run_workers(BUCKETS, timeout=60)]
    ref = _branchy_reference()
    for rank, result in enumerate(results):
        bucketed, alone = result["280"], result["0"]
        assert bucketed["buckets"] == ns["BRANCHY_BUCKETS"]
        assert bucketed["collectives"] == [4] * 6, rank             # not the 8 of one per parameter
        assert alone["collectives"] == [8] * 6, rank
        # elementwise sums: buckets change nothing, bit for bit (two workers: a + b either way)
        assert bucketed["weights"] == alone["weights"], rank
        np.testing.assert_allclose(bucketed["weights"], ref, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
    assert results[0]["280"]["weights"] == results[1]["280"]["weights"]
    assert c.wait_daemons() == [0]


ASYNC = COMMON + r'''
kv = kt.init("async")
r, W = kv.rank, kv.num_workers
model = make_model()
opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model.named_parameters(),
                              mode="async", update_on=os.environ["UPDATE_ON"])
losses = train(model, opt, STEPS, r, W)
last = kt.join()                                          # every push is in: read the servers' weights
opt.zero_grad()
opt.step()                                                # no gradients: it pushes nothing and pulls
try:
    kt.broadcast_parameters({"x": torch.zeros(2)}, root_rank=1)
except ValueError as exc:
    refused = str(exc)
print(json.dumps({"losses": losses, "final": full_loss(model), "last": last, "refused": refused}), flush=True)
'''


def _every_push_reference(update_on):
    """Async applies each worker's half-batch update on its own: one process making the same
    updates in turn, without the staleness, is where async training should end up near. The
    servers keep one momentum for all pushes; workers that push deltas keep one each."""
    F = torch.nn.functional
    model = ns["make_model"]()
    params = list(model.parameters())
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(1 if update_on == "server" else 2)]
    for step in range(ns["STEPS"]):
        x, y = ns["batch"](step)
        for r in range(2):
            model.zero_grad()
            F.cross_entropy(model(x[r::2]), y[r::2]).backward()
            with torch.no_grad():
                for p, m in zip(params, momenta[r % len(momenta)]):
                    m.mul_(0.9).add_(p.grad)
                    p.sub_(ns["LR"] * m)
    return ns["full_loss"](model)


@pytest.mark.parametrize("update_on", ["server", "worker"])
def test_async_trains(cluster, update_on):
    c = cluster(2, 1)
    results = c.run_workers(ASYNC, timeout=90, env={"UPDATE_ON": update_on})
    start, ref = ns["full_loss"](ns["make_model"]()), _every_push_reference(update_on)
    finals = [lines[0]["final"] for lines in results]
    for lines in results:
        losses = lines[0]["losses"]
        # Async interleaving depends on scheduling: on a loaded machine one worker may run most of its
        # steps before the other's pushes land, so each worker's own curve must fall, and the final
        # weights (every push in, after join) must train and land near the every-push reference.
        assert losses[-1] < 0.75 * start, (losses, start)
        final = lines[0]["final"]
        assert final < 0.5 * start and abs(final - ref) < 0.25 * start, (final, ref, start)
    assert finals[0] == pytest.approx(finals[1], rel=1e-6)    # both read the servers' weights at the end
    assert results[0][0]["last"] == results[1][0]["last"] in (0, 1)
    assert "use root_rank=0" in results[0][0]["refused"]        # dist_async cannot sum a broadcast
    assert c.wait_daemons() == [0, 0]


JOIN = COMMON + r'''
mode = os.environ["MODE"]
kv = kt.init(mode)
r, W = kv.rank, kv.num_workers
model = make_model()
opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), mode=mode)
train(model, opt, 8 if r == 0 else 3, r, W)              # rank 1 runs out of data after 3 steps
last = kt.join()
kt.broadcast_parameters(model.state_dict(), root_rank=last)   # the worker that trained longest
print(json.dumps({"stage": "joined", "last": last, "weights": flat(model)}), flush=True)
train(model, opt, 1, r, W)                                # a next epoch: everyone takes part again
print(json.dumps({"stage": "epoch2", "weights": flat(model)}), flush=True)
'''


def _uneven_reference():
    """Rank 1 joins after 3 of rank 0's 8 steps: it adds zeros, and the sum is still divided by 2."""
    F = torch.nn.functional
    model = ns["make_model"]()
    opt = torch.optim.SGD(model.parameters(), lr=ns["LR"])
    flats = []
    for step in range(9):
        x, y = ns["batch"](step if step < 8 else 0)
        opt.zero_grad()
        active = (0, 1) if step < 3 or step == 8 else (0,)
        sum(F.cross_entropy(model(x[r::2]), y[r::2]) for r in active).div(2).backward()
        opt.step()
        if step >= 7:
            flats.append(ns["flat"](model))
    return flats


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_join_with_uneven_data(cluster, mode):
    # two servers, and keys of 64+ elements split over both: JOIN must reach every server
    c = cluster(2, 2 if mode == "sync" else 0, env={"KVPS_BIGARRAY_BOUND": "64"})
    results = [by_stage(lines) for lines in c.run_workers(JOIN, timeout=90, env={"MODE": mode})]
    joined, epoch2 = _uneven_reference()
    for rank, stages in enumerate(results):
        assert stages["joined"]["last"] == 0
        np.testing.assert_allclose(stages["joined"]["weights"], joined, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
        np.testing.assert_allclose(stages["epoch2"]["weights"], epoch2, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
    assert results[0]["joined"]["weights"] == results[1]["joined"]["weights"]
    assert c.wait_daemons() == [0] * (1 + c.servers)
