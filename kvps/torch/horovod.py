"""Horovod's process API on kvps, so `import kvps.torch as hvd` runs a horovod.torch script:
hvd.init(), rank(), size(), local_rank(), local_size(), allreduce, allgather, broadcast,
broadcast_object, allgather_object, alltoall, reducescatter, Compression, Average, Sum, Min, Max and Product (DistributedOptimizer, broadcast_parameters,
broadcast_optimizer_state and join are kvps.torch's own, with Horovod's arguments).

Collectives are named by the tensor's `name` (Horovod's name=) or, without one, by its dtype
and shape: every worker must make the same calls in the same order, as Horovod requires. They
run on the process's kvstore (kvps.torch.init) as a summing pushpull, so they need a dist_sync
or allreduce kvstore, not a dist_async one with a server optimizer.
"""
import json
import weakref

import torch

from kvps.torch.broadcast import _broadcast, _broadcast_json
from kvps.torch.session import _SESSION, SUMMING
from kvps.wire.requests import Handle


class ReduceOp:
    """Horovod's reduction ops: hvd.Average (the default) and hvd.Sum, and for allreduce hvd.Min, hvd.Max
    and hvd.Product."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"hvd.{self.name}"


Average, Sum, Adasum = ReduceOp("Average"), ReduceOp("Sum"), ReduceOp("Adasum")
Min, Max, Product = ReduceOp("Min"), ReduceOp("Max"), ReduceOp("Product")
GATHERED = {Min: lambda rows: rows.amin(0), Max: lambda rows: rows.amax(0), Product: lambda rows: rows.prod(0)}


class Compression:
    """Horovod's hvd.Compression.none and hvd.Compression.fp16, as DistributedOptimizer's
    compression= takes them (kvps's own names: "fp16", "bf16", "2bit", "1bit", "topk")."""
    none = None
    fp16 = "fp16"
    bf16 = "bf16"


def reduction(op, average=None):
    """True to average, False to sum, from Horovod's op= (or its older average=)."""
    if op is not None and average is not None:
        raise ValueError("give op= or average=, not both (average= is Horovod's older spelling)")
    if op is None:
        return True if average is None else bool(average)
    if op is Adasum:
        raise ValueError("hvd.Adasum is not supported by kvps: use hvd.Average or hvd.Sum")
    if op not in (Average, Sum):
        also = " (hvd.allreduce takes it, gradients do not)" if op in GATHERED else ""
        raise ValueError(f"op={op!r} is not hvd.Average or hvd.Sum{also}")
    return op is Average


def _kv():
    return _SESSION.kvstore()


def rank():
    return _kv().rank


def size():
    return _kv().num_workers


def _hosts():
    """The host of each worker rank, from the scheduler's membership (one host for a local kvstore)."""
    kv = _kv()
    node = getattr(kv, "_node", None)
    membership = getattr(node, "membership", None) or {}
    workers = membership.get("workers")
    if not workers:
        return ["localhost"] * kv.num_workers
    return [w[0] for w in workers]


def local_rank():
    """This worker's index among the workers on its host (for torch.cuda.set_device)."""
    hosts = _hosts()
    me = rank()
    return sum(1 for r in range(me) if hosts[r] == hosts[me])


def local_size():
    hosts = _hosts()
    return hosts.count(hosts[rank()])


def cross_rank():
    """The index of this worker's host among the job's hosts (in the order of their first rank)."""
    hosts = _hosts()
    return list(dict.fromkeys(hosts)).index(hosts[rank()])


def cross_size():
    return len(set(_hosts()))


def is_initialized():
    return _SESSION.kv is not None


# What Horovod's scripts ask about its build: kvps has its own ring (gloo-like) and no MPI or NCCL.
def nccl_built():
    return False


def mpi_built():
    return False


def mpi_enabled():
    return False


def mpi_threads_supported():
    return False


def gloo_built():
    return True


def gloo_enabled():
    return True


def barrier():
    """Wait until every worker reaches the barrier (Horovod's hvd.barrier, since 0.23)."""
    _kv().barrier()


def shutdown():
    """Leave the job (close the process's kvstore); a later kvps.torch call starts no new one."""
    if _SESSION.kv is not None:
        _SESSION.kv.close()


_DECLARED = weakref.WeakKeyDictionary()       # kvstore -> {allreduce key: (dtype, shape)}
_REFUSED = "kvps.torch: refused"               # a JSON object that stands for "the sender's object was not JSON"


def _summing_kv(what, tensor):
    """The process's kvstore, after checking that `tensor` is a tensor and the kvstore's pushpull sums."""
    if not torch.is_tensor(tensor):
        raise TypeError(f"{what} takes a torch tensor, not a {type(tensor).__name__}")
    kv = _kv()
    if kv.type not in SUMMING:
        raise ValueError(f"hvd.{what} needs a kvstore whose pushpull sums (dist_sync, allreduce); this "
                         f"process's is {kv.type}")
    return kv


def _dtype_name(tensor):
    return str(tensor.dtype).split(".")[1]


def _json(obj, what):
    """obj as JSON text, or, when JSON cannot carry it, a refusal every receiver raises (none waits)."""
    try:
        return json.dumps(obj)
    except (TypeError, ValueError) as exc:
        return json.dumps({_REFUSED: f"{what} sends JSON, never pickle: {exc}"})


def _unless_refused(got, whose):
    if isinstance(got, dict) and _REFUSED in got:
        raise TypeError(f"{got[_REFUSED]} ({whose})")
    return got


def exact(compression, call):
    """Collectives travel exact: compression belongs to DistributedOptimizer (ValueError otherwise)."""
    if compression not in (None, Compression.none):
        raise ValueError(f"{call}(compression=...) is not supported: compress in DistributedOptimizer")


class Pending:
    """An allreduce on its way (Horovod's handle, from allreduce_async_): poll(handle) says whether
    it is done, synchronize(handle) waits and gives the tensor."""

    def __init__(self, handle, tensor, value, work, mean, workers, post=1.0):
        self.handle, self.tensor, self._value, self._work, self._mean, self._workers = \
            handle, tensor, value, work, mean, workers
        self._post = post                   # Horovod's postscale_factor
        self._finished = False

    def done(self):
        return self.handle.done()

    def result(self):
        if not self._finished:
            self.handle.wait()
            work = self._work
            if self._mean and self._workers > 1:
                work.div_(self._workers) if work.is_floating_point() else work.floor_divide_(self._workers)
            if self._post != 1.0:
                work.mul_(self._post)
            if work is not self._value:
                self._value.copy_(work)
            self._finished = True
        return self.tensor


def _start(tensor, average, name, op, priority=0, prescale=1.0, postscale=1.0, process_set=None):
    """Send `tensor`'s sum over every worker on its way: a Pending. prescale and postscale are
    Horovod's prescale_factor and postscale_factor: the tensor is multiplied by the one before the
    reduction, and the result by the other after it (and after an average's division)."""
    _whole_job(process_set)
    if op in GATHERED:
        if average is not None:
            raise ValueError("give op= or average=, not both (average= is Horovod's older spelling)")
        if prescale != 1.0:
            tensor.detach().mul_(prescale)
        pending = _by_gather(tensor, name, op)
        if postscale != 1.0:
            tensor.detach().mul_(postscale)
        return pending
    mean = reduction(op, average)
    kv = _summing_kv("allreduce", tensor)
    value = tensor.detach()
    if tensor.numel() == 0:
        return Pending(Handle.completed("an empty allreduce"), tensor, value, value, False, 1)
    key = f"kvps.torch/allreduce/{name if name is not None else _dtype_name(tensor) + str(list(tensor.shape))}"
    work = value if value.device.type == "cpu" and value.is_contiguous() else value.cpu().contiguous()
    if work.dtype == torch.float32 and getattr(kv, "_codec", None) is not None:
        # The kvstore compresses float32 values (DistributedOptimizer's compression=, which is
        # Horovod's per optimizer): Horovod's allreduce is exact, so this one travels as float64.
        work = work.double()
    declared = _DECLARED.setdefault(kv, {})
    if key not in declared:
        kv.init(key, torch.zeros_like(work))
        declared[key] = (work.dtype, tuple(work.shape))
    elif declared[key] != (work.dtype, tuple(work.shape)):
        raise ValueError(f"hvd.allreduce name={name!r} was {declared[key][0]} {declared[key][1]} and is now "
                         f"{work.dtype} {tuple(work.shape)}: give each tensor its own name")
    if prescale != 1.0:
        work.mul_(prescale)
    handle = kv.pushpull(key, work, out=work, priority=priority, async_op=True)
    return Pending(handle, tensor, value, work, mean, kv.num_workers, postscale)


def _by_gather(tensor, name, op):
    """hvd.Min, Max and Product: the servers and the ring only sum, so every worker's tensor is
    gathered (the workers' count times its bytes: for metrics, not gradients) and reduced here, the
    same way on every worker. Done when it returns."""
    value = tensor.detach()
    if value.numel():
        rows, _ = _gather(value.unsqueeze(0), f"{op.name}/{name}" if name is not None else op.name)
        value.copy_(GATHERED[op](rows).reshape(value.shape))
    return Pending(Handle.completed(f"an allreduce ({op!r})"), tensor, value, value, False, 1)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None):
    """Sum or average `tensor` over every worker, in place; returns it."""
    return _start(tensor, average, name, op, prescale=prescale_factor, postscale=postscale_factor,
                  process_set=process_set).result()


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    """allreduce_ without waiting: a handle for poll() and synchronize(), which gives `tensor`
    (summed or averaged in place). Every worker must start the same allreduces in the same order."""
    return _start(tensor, average, name, op, prescale=prescale_factor, postscale=postscale_factor,
                  process_set=process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    """allreduce without waiting: synchronize(handle) gives the result as a new tensor."""
    return _start(tensor.detach().clone(), average, name, op, prescale=prescale_factor,
                  postscale=postscale_factor, process_set=process_set)


class Group:
    """The allreduces of one grouped call (grouped_allreduce_async_): done when all are; its result
    is the list of their tensors."""

    def __init__(self, pending):
        self.pending = pending

    def done(self):
        return all(p.done() for p in self.pending)

    def result(self):
        return [p.result() for p in self.pending]


def _group(tensors, average, name, op, prescale, postscale, process_set):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_allreduce takes a list of tensors, not a {type(tensors).__name__}")
    return Group([_start(t, average, None if name is None else f"{name}.{i}", op, prescale=prescale,
                         postscale=postscale, process_set=process_set) for i, t in enumerate(tensors)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None):
    """Horovod's grouped allreduce without waiting: every tensor summed or averaged in place; a handle
    for poll() and synchronize(), which gives the list."""
    return _group(tensors, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    """Sum or average every tensor of the list over every worker, in place; returns the list."""
    return _group(tensors, average, name, op, prescale_factor, postscale_factor, process_set).result()


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None):
    """grouped_allreduce without waiting: synchronize(handle) gives the results as new tensors."""
    return _group([t.detach().clone() for t in tensors], average, name, op, prescale_factor, postscale_factor,
                  process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None):
    """The sums or averages of a list of tensors over every worker, as new tensors (Horovod's
    hvd.grouped_allreduce: one call for many tensors; its arguments, in its order)."""
    exact(compression, "hvd.grouped_allreduce")
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_set).result()


def poll(handle):
    """Whether the allreduce (or group) of `handle` is done (synchronize then returns at once)."""
    return handle.done()


def synchronize(handle):
    """Wait for the allreduce of `handle`: its tensor (a group's: the list). Raises its error (a dead
    peer, a timeout)."""
    return handle.result()


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """The sum or average of `tensor` over every worker, as a new tensor (Horovod's hvd.allreduce,
    its arguments in its order). Differentiable, as Horovod's: the gradient is reduced the same way."""
    exact(compression, "hvd.allreduce")
    options = dict(prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)
    if _differentiable(tensor):
        return _Allreduce.apply(tensor, average, name, op, options)
    return allreduce_(tensor.detach().clone(), average, name, op, **options)


class _WholeJob:
    """Horovod's global process set, the only one kvps has: every worker of the job."""

    def rank(self):
        return _kv().rank

    def size(self):
        return _kv().num_workers

    def included(self):
        return True

    def __repr__(self):
        return "hvd.global_process_set"


global_process_set = _WholeJob()


def _whole_job(process_set):
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"process_set={process_set!r}: kvps has no process sets; its collectives "
                                  f"span every worker of the job (hvd.global_process_set)")


def _differentiable(tensor):
    return torch.is_tensor(tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _grad_name(name):
    return None if name is None else f"{name}/grad"


class _Allreduce(torch.autograd.Function):
    """hvd.allreduce on a tensor that needs a gradient: backward reduces the gradient with the same
    op (Horovod's HorovodAllreduce)."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, options):
        ctx.average, ctx.name, ctx.op, ctx.options = average, name, op, options
        return allreduce_(tensor.detach().clone(), average, name, op, **options)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_(grad.detach().clone(), ctx.average, _grad_name(ctx.name), ctx.op, **ctx.options)
        return reduced, None, None, None, None


def _gather(tensor, name):
    """(every worker's rows of `tensor` in rank order, each worker's row count). Each worker writes
    its rows into zeros at its offset and a summing pushpull puts them together."""
    kv = _summing_kv("allgather", tensor)
    value = tensor.detach().cpu()
    if value.dim() == 0:
        value = value.reshape(1)
    rows = torch.zeros(kv.num_workers, dtype=torch.int64)
    rows[kv.rank] = value.shape[0]
    tag = name if name is not None else _dtype_name(value) + str(list(value.shape[1:]))
    allreduce_(rows, name=f"allgather/{tag}/rows", op=Sum)
    total, start = int(rows.sum()), int(rows[:kv.rank].sum())
    out = torch.zeros((total, *value.shape[1:]), dtype=value.dtype)
    out[start:start + value.shape[0]] = value
    exact = out if out.is_floating_point() or out.dtype in (torch.int32, torch.int64) else out.to(torch.int64)
    allreduce_(exact, name=f"allgather/{tag}/{total}", op=Sum)
    return (exact if exact is out else exact.to(value.dtype)), rows.tolist()


def allgather(tensor, name=None):
    """Every worker's `tensor` concatenated along the first dimension, in rank order (Horovod's
    hvd.allgather: the first dimension may differ between workers, the others must not).
    Differentiable, as Horovod's: each worker's gradient is its rows of the workers' averaged one."""
    if _differentiable(tensor):
        return _Allgather.apply(tensor, name)
    return _gather(tensor, name)[0].to(tensor.device)


class _Allgather(torch.autograd.Function):
    """hvd.allgather on a tensor that needs a gradient (a contrastive loss over every worker's
    batch): backward averages the gathered gradient over the workers and keeps this worker's rows
    (Horovod's HorovodAllgather)."""

    @staticmethod
    def forward(ctx, tensor, name):
        out, rows = _gather(tensor, name)
        rank_ = _kv().rank
        ctx.name, ctx.shape = name, tensor.shape
        ctx.start, ctx.rows = sum(rows[:rank_]), rows[rank_]
        return out.to(tensor.device)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_(grad.detach().clone(), name=_grad_name(ctx.name), op=Average)
        return reduced.narrow(0, ctx.start, ctx.rows).reshape(ctx.shape), None


def alltoall(tensor, splits=None, name=None):
    """Horovod's hvd.alltoall: rows splits[i] of `tensor` (along the first dimension, in order) go to
    worker i, and this worker gets the rows every worker sent it, in rank order. Without splits the
    first dimension is cut into equal parts, one per worker. Returns the rows; given splits, also the
    number received from each worker (an int32 tensor). Differentiable, as Horovod's. Built on
    allgather: every worker receives every worker's tensor (the workers' count times its bytes), so
    it suits routing tables and small exchanges, not the bulk of a mixture of experts."""
    if _differentiable(tensor):
        return _Alltoall.apply(tensor, splits, name)
    output, received = _alltoall(tensor, splits, name)
    return output if splits is None else (output, received)


def _alltoall(tensor, splits, name):
    kv = _summing_kv("alltoall", tensor)
    workers, me = kv.num_workers, kv.rank
    value = tensor.detach()
    if value.dim() == 0:
        raise ValueError("hvd.alltoall takes a tensor of at least one dimension (its rows are sent)")
    n = value.shape[0]
    if splits is None:
        if n % workers:
            raise ValueError(f"hvd.alltoall without splits cuts the first dimension ({n}) into {workers} equal "
                             f"parts, one per worker: it must divide (or give splits=)")
        send = [n // workers] * workers
    else:
        send = [int(x) for x in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(send) != workers or min(send) < 0 or sum(send) != n:
            raise ValueError(f"hvd.alltoall splits={send} must be {workers} counts >= 0 (one per worker) that add "
                             f"up to the first dimension ({n})")
    tag = name if name is not None else _dtype_name(value) + str(list(value.shape[1:]))
    matrix = torch.zeros(workers, workers, dtype=torch.int64)      # [sender][receiver]: every worker's splits
    matrix[me] = torch.tensor(send)
    allreduce_(matrix, name=f"alltoall/{tag}/splits", op=Sum)
    rows, _ = _gather(value, f"alltoall/{tag}")
    parts, start = [], 0
    for sender in range(workers):
        offset = start + int(matrix[sender, :me].sum())
        parts.append(rows[offset:offset + int(matrix[sender, me])])
        start += int(matrix[sender].sum())
    return torch.cat(parts).to(tensor.device), matrix[:, me].to(torch.int32)


class _Alltoall(torch.autograd.Function):
    """hvd.alltoall on a tensor that needs a gradient: backward sends each row's gradient back to
    the worker it came from (an alltoall with the received counts as splits), as Horovod's."""

    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received = _alltoall(tensor, splits, name)
        ctx.received, ctx.name = received, name
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = _alltoall(grad.detach().contiguous(), ctx.received, _grad_name(ctx.name))
        return back, None, None


def reducescatter(tensor, name=None, op=None, compression=None):
    """Horovod's hvd.reducescatter: the sum (op=hvd.Sum) or mean (hvd.Average, the default) of
    `tensor` over every worker, of which this worker keeps its part of the first dimension: equal
    parts, the first (rows % workers) workers one row more. Built on allreduce (the whole tensor
    travels); not differentiable."""
    exact(compression, "hvd.reducescatter")
    kv = _summing_kv("reducescatter", tensor)
    if tensor.dim() == 0:
        raise ValueError("hvd.reducescatter takes a tensor of at least one dimension (its rows are scattered)")
    whole = allreduce_(tensor.detach().clone(), name=None if name is None else f"reducescatter/{name}",
                       op=Average if op is None else op)
    rows, workers, me = tensor.shape[0], kv.num_workers, kv.rank
    base, extra = divmod(rows, workers)
    start = me * base + min(me, extra)
    return whole[start:start + base + (me < extra)].clone()


def allgather_object(obj, name=None):
    """Every worker's `obj` in a list, in rank order; JSON, never pickle (as broadcast_object)."""
    data = _json(obj, "allgather_object").encode()
    parts, sizes = _gather(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32), name)
    out, start = [], 0
    for r, n in enumerate(sizes):
        out.append(_unless_refused(json.loads(bytes(parts[start:start + n].to(torch.uint8).tolist())),
                                   f"rank {r}'s object"))
        start += n
    return out


def broadcast_(tensor, root_rank, name=None):
    """Overwrite `tensor` with root_rank's, in place; returns it."""
    if not torch.is_tensor(tensor):
        raise TypeError(f"broadcast takes a torch tensor, not a {type(tensor).__name__}")
    _broadcast([(name or "tensor", tensor)], root_rank, _kv(), "b")
    return tensor


def broadcast(tensor, root_rank, name=None):
    """root_rank's `tensor`, as a new tensor on every worker. Differentiable, as Horovod's: the root
    gets the workers' averaged gradient, the others zeros."""
    if _differentiable(tensor):
        return _Broadcast.apply(tensor, root_rank, name)
    return broadcast_(tensor.detach().clone(), root_rank, name)


class _Broadcast(torch.autograd.Function):
    """hvd.broadcast on a tensor that needs a gradient (Horovod's HorovodBroadcast)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root, ctx.name = root_rank, name
        return broadcast_(tensor.detach().clone(), root_rank, name)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce_(grad.detach().clone(), name=_grad_name(ctx.name), op=Average)
        if _kv().rank != ctx.root:
            reduced.zero_()
        return reduced, None, None


def broadcast_object(obj, root_rank=0, name=None):
    """root_rank's `obj` on every worker. kvps sends it as JSON, never pickle (docs/security.md):
    dicts, lists, strings, numbers, booleans and None; anything else is a TypeError on every worker."""
    kv = _kv()
    sent = json.loads(_json(obj, "broadcast_object")) if kv.rank == root_rank else None
    return _unless_refused(_broadcast_json(sent, root_rank, kv), f"root_rank {root_rank}'s object")
