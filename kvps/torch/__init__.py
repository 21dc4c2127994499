"""torch training on kvps: a distributed optimizer, broadcasts of parameters and optimizer state, join().

    import kvps.torch as kt
    opt = kt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), mode="sync")     # sync | async | allreduce
    kt.broadcast_parameters(model.state_dict(), root_rank=0)
    kt.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in my_shard:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    kt.join()                  # every worker calls it when its data runs out

sync and allreduce: gradients are grouped into buckets (as torch DDP groups them) and each bucket
is sent (one pushpull, summed over workers) from a backward hook as soon as its last gradient is
ready; step() waits for those replies, divides by the number of workers and runs the wrapped
torch optimizer locally. async: the servers run the optimizer (translated into
kvps.optimizer, MXNet's formulas) on each worker's gradient as it arrives and workers pull fresh
weights; or, with update_on="worker", workers step locally and push weight deltas.

The package is named after torch but shadows nothing: kvps imports torch absolutely, so
`import torch` here, in this package's modules and in kvps.arrays is the real torch.
docs/torch.md has the details.

Its modules: session (the modes, the process's kvstore, init, join), broadcast, bucketing,
optimizer (DistributedOptimizer), rules (torch optimizers as server-side update rules) and
horovod (Horovod's process API: `import kvps.torch as hvd` runs a horovod.torch script), elastic
(hvd.elastic.run and TorchState), sync_batchnorm (hvd.SyncBatchNorm) and byteps
(BytePS's push_pull names on top of it: `import kvps.torch as bps`).
"""
import torch  # noqa: F401  (kvps.torch.torch is the real torch: see the docstring)

from kvps.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from kvps.torch.byteps import (declare, push_pull, push_pull_async, push_pull_async_inplace, push_pull_inplace)
from kvps.torch.horovod import (Adasum, Average, Compression, Max, Min, Product, Sum, allgather, allgather_object, allreduce,
                                alltoall, global_process_set, reducescatter,
                                allreduce_, allreduce_async, allreduce_async_, barrier, broadcast, broadcast_,
                                broadcast_object, cross_rank, cross_size, gloo_built, gloo_enabled, grouped_allreduce,
                                grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                                is_initialized, local_rank,
                                local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank,
                                shutdown, size, synchronize)
from kvps.torch import elastic
from kvps.torch.bucketing import BUCKET_BYTES, FIRST_BUCKET_BYTES, buckets
from kvps.torch.optimizer import DistributedOptimizer
from kvps.torch.server_optimizer import server_optimizer
from kvps.torch.sync_batchnorm import SyncBatchNorm
from kvps.torch.session import ASYNC, MODES, SUMMING, Session, init, join

__all__ = ["init", "join", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
           "buckets", "server_optimizer", "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "MODES", "SUMMING", "ASYNC",
           "Session",
           # Horovod's names (kvps/torch/horovod.py): import kvps.torch as hvd
           "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_initialized", "shutdown",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "poll", "synchronize",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather", "allgather_object", "broadcast", "broadcast_", "broadcast_object", "barrier",
           "alltoall", "reducescatter", "global_process_set",
           "Compression", "Average", "Sum", "Adasum", "Min", "Max", "Product", "nccl_built", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "elastic", "SyncBatchNorm",
           # BytePS's (kvps/torch/byteps.py): import kvps.torch as bps
           "push_pull", "push_pull_inplace", "push_pull_async", "push_pull_async_inplace", "declare"]
