"""A horovod.torch script, written as Horovod's examples write it, runs on kvps with only its import
changed (`import kvps.torch as hvd`), on a ring job (kvps launch -s 0) and on a server job; so do
Horovod's asynchronous and grouped allreduce, its elastic API (hvd.elastic.run, TorchState) and
BytePS's push_pull names (`import kvps.torch as bps`); hvd.SyncBatchNorm normalizes over every
worker's batch as torch's BatchNorm does over the whole batch in one process."""

import numpy as np
import pytest

HOROVOD = r'''
import json
import torch
import torch.nn.functional as F
import kvps.torch as hvd

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
       "cross_size": hvd.cross_size(), "initialized": hvd.is_initialized()}
g = torch.Generator().manual_seed(0)
X = torch.randn(256, 10, generator=g)
Y = (X[:, :5].sum(1) > 0).long()
shard = range(hvd.rank(), 256, hvd.size())            # DistributedSampler(num_replicas=size, rank=rank)
model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
lr_scaler = hvd.local_size() if hvd.nccl_built() else 1
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16, op=hvd.Average,
                                     gradient_predivide_factor=2.0)

def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()

losses = []
for epoch in range(3):
    for i in range(0, len(shard), 16):
        idx = torch.tensor(list(shard)[i:i + 16])
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        local = F.cross_entropy(model(X[list(shard)]), Y[list(shard)]).item()
    losses.append({"local": local, "avg": metric_average(local, "avg_loss")})
out["losses"] = losses
out["weights"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
counts = hvd.allreduce(torch.tensor([1, hvd.rank()]), op=hvd.Sum)       # unnamed, integer, summed
out["counts"] = counts.tolist()
out["from1"] = hvd.broadcast(torch.full((3,), float(hvd.rank())), root_rank=1).tolist()
out["object"] = hvd.broadcast_object({"epoch": 3, "rank": hvd.rank()}, root_rank=0)
hvd.barrier()
out["minmax"] = [hvd.allreduce(torch.tensor([float(hvd.rank()), -float(hvd.rank())]), op=hvd.Max).tolist(),
                 hvd.allreduce(torch.tensor(hvd.rank() + 2.5), op=hvd.Min, name="m").item(),
                 hvd.allreduce(torch.tensor([hvd.rank() + 2, 3]), op=hvd.Product).tolist()]
mine = torch.arange(2 + hvd.rank(), dtype=torch.float32).reshape(-1, 1) + 10 * hvd.rank()   # 2 and 3 rows
out["gathered"] = hvd.allgather(mine, name="rows").reshape(-1).tolist()
out["gathered_int"] = hvd.allgather(torch.tensor([hvd.rank() + 1], dtype=torch.int8)).tolist()
out["objects"] = hvd.allgather_object({"rank": hvd.rank(), "word": "ab" * (hvd.rank() + 1)})
try:
    hvd.broadcast_object({"f": lambda: None} if hvd.rank() == 0 else None, root_rank=0)
except TypeError as exc:
    out["refused"] = str(exc)
# op=hvd.Sum leaves the summed gradients; check them against each rank's own
model2 = torch.nn.Linear(4, 1)
hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1), model2.named_parameters(),
                                op=hvd.Sum)
x = torch.full((2, 4), float(hvd.rank() + 1))
model2(x).sum().backward()
# this rank's own gradient, d(sum of x @ w)/dw = x summed over the batch: not read from .grad, which
# the allreduce started by backward() may already be overwriting in place (as Horovod's does)
out["own_grad"] = x.sum(0).tolist()
opt2.synchronize()
out["sum_grad"] = model2.weight.grad.reshape(-1).tolist()
# a sparse gradient (nn.Embedding(sparse=True)) goes dense, as with Horovod's sparse_as_dense=True
emb = torch.nn.Embedding(6, 2, sparse=True)
hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
out["emb0"] = emb.weight.detach().tolist()
opt3 = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), emb.named_parameters(),
                                sparse_as_dense=True)
emb(torch.tensor([hvd.rank()])).sum().backward()
opt3.step()
out["emb"] = emb.weight.detach().tolist()
# Horovod's asynchronous allreduce, and BytePS's names for the same (import kvps.torch as bps)
h = hvd.allreduce_async_(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Sum, name="async")
while not hvd.poll(h):
    pass
out["async_sum"] = hvd.synchronize(h).tolist()
group = hvd.grouped_allreduce([torch.full((2,), float(hvd.rank())), torch.ones(3, dtype=torch.float64)], name="g")
out["grouped"] = [t.tolist() for t in group]
bps = hvd
bps.declare("pp")
out["push_pull"] = bps.push_pull(torch.tensor([float(bps.rank())]), name="pp").tolist()
handle = bps.push_pull_async_inplace(torch.ones(2) * (bps.rank() + 1), average=False, name="ppa", priority=3)
out["push_pull_async"] = bps.synchronize(handle).tolist()
# Horovod's elastic API: rank 0's state (weights and epoch) everywhere, then the epochs from there
torch.manual_seed(hvd.rank())           # each rank starts with weights of its own
model3 = torch.nn.Linear(3, 1)
opt4 = hvd.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1), model3.named_parameters())

@hvd.elastic.run
def train_elastic(state):
    for state.epoch in range(state.epoch, 3):
        opt4.zero_grad()
        model3(torch.ones(2, 3) * (hvd.rank() + 1)).sum().backward()
        opt4.step()
        state.commit()
    return state.epoch

state = hvd.elastic.TorchState(model3, opt4, epoch=1 if hvd.rank() == 0 else 0)
out["elastic_epoch"] = train_elastic(state)
out["elastic_w"] = model3.weight.detach().reshape(-1).tolist()
# Horovod's elastic sampler: a worker's samples recorded before the run (an interrupted epoch 0)
# are merged by the state's sync and left out of the rest of that epoch on every worker
data = list(range(22))
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
sampler.record_indices([0, 1] if hvd.rank() == 1 else [2])
state2 = hvd.elastic.TorchState(model3, opt4, train_sampler=sampler, epoch=0, batch=0)

@hvd.elastic.run
def sample(state):
    seen = []
    for state.epoch in range(state.epoch, 2):
        state.train_sampler.set_epoch(state.epoch)
        loader = torch.utils.data.DataLoader(data, batch_size=3, sampler=state.train_sampler)
        for state.batch, batch in enumerate(loader):
            seen.append([state.epoch] + batch.tolist())
            state.train_sampler.record_batch(state.batch, 3)
            state.commit()
    return seen

out["sampled"] = sample(state2)
print(json.dumps(out), flush=True)
hvd.shutdown()
'''


@pytest.mark.parametrize("servers", [0, 1])
def test_a_horovod_script_runs_with_its_import_changed(cluster, servers):
    c = cluster(2, servers)
    results = [lines[0] for lines in c.run_workers(HOROVOD, timeout=90)]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"], r["initialized"]) == \
            (2, r["rank"], 2, 1, True), r
        assert r["counts"] == [2, 1] and r["from1"] == [1.0] * 3, r
        assert r["object"] == {"epoch": 3, "rank": 0}, r
        assert r["minmax"] == [[1.0, 0.0], 2.5, [6, 9]], r
        assert r["gathered"] == [0.0, 1.0, 10.0, 11.0, 12.0] and r["gathered_int"] == [1, 2], r
        assert r["objects"] == [{"rank": 0, "word": "ab"}, {"rank": 1, "word": "abab"}], r
        assert "never pickle" in r["refused"] and "root_rank 0" in r["refused"], r
        for epoch, e in enumerate(r["losses"]):
            mean = np.mean([other["losses"][epoch]["local"] for other in results])
            assert e["avg"] == pytest.approx(mean, rel=1e-6), (epoch, e)
    # every step averaged the same gradients: the workers end with the same weights, and it learned
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["losses"][-1]["avg"] < 0.6 * results[0]["losses"][0]["avg"] + 0.3
    summed = np.add(results[0]["own_grad"], results[1]["own_grad"])
    for r in results:
        np.testing.assert_allclose(r["sum_grad"], summed, rtol=1e-6)
    # rows 0 and 1 each got one worker's gradient of ones, averaged over 2 workers: -0.5 each
    assert results[0]["emb"] == results[1]["emb"]
    np.testing.assert_allclose(results[0]["emb"], np.add(results[0]["emb0"], [[-0.5] * 2] * 2 + [[0] * 2] * 4),
                               rtol=1e-6)
    for r in results:
        assert (r["async_sum"], r["push_pull"], r["push_pull_async"]) == ([3.0] * 3, [0.5], [3.0, 3.0]), r
        assert r["grouped"] == [[0.5, 0.5], [1.0, 1.0, 1.0]], r
        assert r["elastic_epoch"] == 2, r            # rank 0's epoch 1, then epochs 1 and 2
    assert results[0]["elastic_w"] == results[1]["elastic_w"]
    for epoch, want in ((0, set(range(3, 22))), (1, set(range(22)))):
        shares = [[i for b in r["sampled"] if b[0] == epoch for i in b[1:]] for r in results]
        assert set(shares[0]).isdisjoint(shares[1]) or len(want) % 2, shares
        assert set(shares[0]) | set(shares[1]) == want, (epoch, shares)
    assert c.wait_daemons() == [0] * (1 + servers)


SYNC_BN = r"""
import json
import torch
import kvps.torch as hvd

hvd.init()
r, w = hvd.rank(), hvd.size()
torch.manual_seed(0)
x_all = torch.randn(4 * w, 3, 5, 5, dtype=torch.float64) * 3 + 1
probe = torch.randn(4 * w, 3, 5, 5, dtype=torch.float64)      # loss = sum(y * probe): no 1/batch to undo
mine = slice(4 * r, 4 * r + 4)

# the whole batch in one process, torch's own layer
ref = torch.nn.BatchNorm2d(3, momentum=0.3).double()
with torch.no_grad():
    ref.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
    ref.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
layers = torch.nn.Sequential(torch.nn.Identity(), torch.nn.BatchNorm2d(3, momentum=0.3)).double()
layers[1].load_state_dict(ref.state_dict())
sync = hvd.SyncBatchNorm.convert_sync_batchnorm(layers)        # as a model's layers are converted
out = {"converted": type(sync[1]).__name__}

x_ref = x_all.clone().requires_grad_()
y_ref = ref(x_ref)
(y_ref * probe).sum().backward()
x = x_all[mine].clone().requires_grad_()
y = sync(x)
(y * probe[mine]).sum().backward()
bn = sync[1]
grads = hvd.allreduce(torch.cat([bn.weight.grad, bn.bias.grad]), op=hvd.Sum)    # each worker's are its own
out["y"] = float((y - y_ref[mine]).abs().max())
out["dx"] = float((x.grad - x_ref.grad[mine]).abs().max())
out["dwb"] = float((grads - torch.cat([ref.weight.grad, ref.bias.grad])).abs().max())
out["running"] = float(max((bn.running_mean - ref.running_mean).abs().max(), (bn.running_var - ref.running_var).abs().max()))
sync.eval(); ref.eval()
out["eval"] = float((sync(x_all[mine]) - ref(x_all[mine])).abs().max())
print(json.dumps(out), flush=True)
hvd.shutdown()
"""


@pytest.mark.parametrize("servers", [0, 1])
def test_sync_batchnorm_normalizes_over_every_workers_batch(cluster, servers):
    for r in [lines[0] for lines in cluster(2, servers).run_workers(SYNC_BN, timeout=90)]:
        assert r["converted"] == "SyncBatchNorm", r
        for name in ("y", "dx", "dwb", "running", "eval"):
            assert r[name] < 1e-9, (name, r)


AMP = r'''
import json, torch, kvps.torch as hvd
hvd.init()
torch.set_num_threads(1)
out = {}
for way in ("naive", "horovod", "clip"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(prefix=way))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(hvd.rank())
    try:
        for step in range(6):
            x = torch.randn(8, 6, generator=g)
            y = (x.sum(1) > 0).long()
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            if way == "naive":           # straight after backward, as torch's AMP recipe writes it
                scaler.step(opt)
            elif way == "horovod":       # Horovod's recipe
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:                        # clipped before the gradients are reduced
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                scaler.step(opt)
            scaler.update()
        out[way] = [p.detach().double().sum().item() for p in model.parameters()]
    except RuntimeError as exc:
        out[way] = str(exc)
        opt.zero_grad()
print(json.dumps(out), flush=True)
'''


def test_grad_scaler_after_backward_steps_with_reduced_gradients_and_a_racing_clip_fails(cluster):
    """torch's AMP recipe (scaler.step(opt) straight after backward) unscaled each worker's own
    gradients while they were being reduced, then stepped with the reduced ones, still scaled: the
    weights blew up and differed between workers (under Horovod too). Now it steps exactly as
    Horovod's recipe does; a clip that races the reduction is a named error, not a lost clip."""
    results = [lines[0] for lines in cluster(2, 1).run_workers(AMP, timeout=90)]
    for r in results:
        assert r["naive"] == r["horovod"], r
        assert "changed in place while being reduced" in r["clip"], r
    assert results[0]["naive"] == results[1]["naive"]


GRADS = r'''
import json, torch, kvps.torch as hvd
hvd.init()
r, W = hvd.rank(), hvd.size()
x = torch.full((r + 1, 2), float(r + 1), requires_grad=True)      # 1 and 2 rows: uneven, as batches end
g = hvd.allgather(x * 2, name="emb")
(g ** 2).sum().backward()
y = torch.full((3,), float(r + 1), requires_grad=True)
hvd.allreduce(y * 3, op=hvd.Sum).sum().backward()
z = torch.full((2,), float(r + 1), requires_grad=True)
(hvd.broadcast(z, root_rank=1) * 5).sum().backward()
with torch.no_grad():
    plain = hvd.allgather(x).requires_grad
print(json.dumps({"gathered": g.tolist(), "dx": x.grad.tolist(), "dy": y.grad.tolist(), "dz": z.grad.tolist(),
                  "plain": plain}), flush=True)
'''


def test_allgather_allreduce_and_broadcast_are_differentiable_as_horovods(cluster):
    """A contrastive loss over every worker's batch (hvd.allgather of embeddings) failed at
    backward(): the results had no gradient. Now they have Horovod's: allgather's is this worker's
    rows of the averaged gathered gradient, allreduce's the gradient reduced with the same op,
    broadcast's the averaged gradient at the root and zeros elsewhere."""
    results = [lines[0] for lines in cluster(2, 1).run_workers(GRADS, timeout=90)]
    gathered = [[2.0, 2.0], [4.0, 4.0], [4.0, 4.0]]
    for r, res in enumerate(results):
        assert res["gathered"] == gathered, res
        # loss = sum(g^2) on every worker: dL/dg = 2g, averaged over 2 identical workers, times 2
        assert res["dx"] == [[8.0 * (r + 1)] * 2] * (r + 1), res
        assert res["dy"] == [6.0] * 3, res                 # d/dy of sum(sum_w 3 y_w), summed again
        assert res["dz"] == ([5.0] * 2 if r == 1 else [0.0] * 2), res
        assert res["plain"] is False


ALLTOALL = r'''
import json, torch, kvps.torch as hvd
hvd.init()
r = hvd.rank()
x = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 100 * r
out = {"equal": hvd.alltoall(x).tolist()}
splits = [1, 3] if r == 0 else [2, 0]                      # W1 sends nothing to itself
rows, received = hvd.alltoall(x[:sum(splits)], splits=torch.tensor(splits, dtype=torch.int32), name="routed")
out["split"], out["received"] = rows.tolist(), received.tolist()
y = x.clone().requires_grad_(True)
o = hvd.alltoall(y * (r + 1), name="grad")
(o * torch.arange(8.0).reshape(4, 2)).sum().backward()
out["grad"] = y.grad.tolist()
out["scattered"] = hvd.reducescatter(torch.arange(5.0) * (r + 1), op=hvd.Sum).tolist()
out["mean"] = hvd.reducescatter(torch.full((4, 1), 2.0 * (r + 1))).reshape(-1).tolist()
try:
    hvd.alltoall(torch.ones(3, 2))
except ValueError as exc:
    out["refused"] = str(exc)
t = torch.full((3,), float(r + 1))
out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist()
out["positional"] = hvd.allreduce(t, None, "pos", hvd.Compression.none, hvd.Average).tolist()    # Horovod's order
out["group"] = hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum, postscale_factor=10.0)[1].tolist()
out["set"] = hvd.global_process_set.size()
print(json.dumps(out), flush=True)
'''


def test_alltoall_reducescatter_and_allreduce_scaling_as_horovods(cluster):
    """Horovod's alltoall (equal parts or splits, the counts received, and its gradient sent back
    where each row came from), reducescatter (the first rows % workers workers one row more), and
    allreduce's prescale_factor and postscale_factor, with its arguments in Horovod's order."""
    a, b = [lines[0] for lines in cluster(2, 0).run_workers(ALLTOALL, timeout=90)]
    assert a["equal"] == [[0, 1], [2, 3], [100, 101], [102, 103]] and b["equal"] == [[4, 5], [6, 7], [104, 105], [106, 107]]
    assert (a["split"], a["received"]) == ([[0, 1], [100, 101], [102, 103]], [1, 2]), a
    assert (b["split"], b["received"]) == ([[2, 3], [4, 5], [6, 7]], [3, 0]), b
    assert a["grad"] == [[0, 1], [2, 3], [0, 1], [2, 3]] and b["grad"] == [[8, 10], [12, 14], [8, 10], [12, 14]]
    assert (a["scattered"], b["scattered"]) == ([0, 3, 6], [9, 12])
    assert (a["mean"], b["mean"]) == ([3, 3], [3, 3])
    assert "cuts the first dimension (3) into 2 equal parts" in a["refused"], a
    for res in (a, b):
        assert res["scaled"] == [3.0] * 3 and res["positional"] == [1.5] * 3 and res["group"] == [60.0] * 3, res
        assert res["set"] == 2
