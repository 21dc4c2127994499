"""BytePS's torch API on kvps, so `import kvps.torch as bps` runs a byteps.torch script: push_pull
and its in-place and asynchronous forms, poll, synchronize and declare. The rest of what BytePS's
scripts call (init, rank, size, local_rank, local_size, shutdown, DistributedOptimizer,
broadcast_parameters, broadcast_optimizer_state, Compression) has Horovod's names, which BytePS
shares (kvps/torch/horovod.py, session.py, optimizer.py, broadcast.py).

BytePS averages by default (average=True); its `version` is accepted and not used; `priority`
orders the sends as kvps's priority does (higher first).
"""
from kvps.torch.horovod import _start, exact


def push_pull_async_inplace(tensor, average=True, name=None, version=0, priority=0):
    """Sum (or average) `tensor` over every worker, in place, without waiting: a handle for
    poll() and synchronize()."""
    return _start(tensor, average, name, None, priority)


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0):
    """Sum (or average) `tensor` over every worker, in place; returns it."""
    return _start(tensor, average, name, None, priority).result()


def push_pull_async(tensor, average=True, name=None, version=0, priority=0):
    """push_pull without waiting: synchronize(handle) gives the result as a new tensor."""
    return _start(tensor.detach().clone(), average, name, None, priority)


def push_pull(tensor, average=True, name=None, version=0, priority=0, compression=None):
    """The sum (or average) of `tensor` over every worker, as a new tensor (BytePS's bps.push_pull)."""
    exact(compression, "bps.push_pull")
    return push_pull_inplace(tensor.detach().clone(), average, name, version, priority)


def declare(name):
    """BytePS declares a tensor's name before its first push_pull; kvps declares it at that first
    call, so this only checks the name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"bps.declare takes a tensor's name (a non-empty str), not {name!r}")
