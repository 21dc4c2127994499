"""Horovod's elastic API on kvps (`hvd.elastic.run`, `hvd.elastic.TorchState`), so a Horovod elastic
script runs with `import kvps.torch as hvd`:

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()
    train(hvd.elastic.TorchState(model, optimizer, train_sampler=hvd.elastic.ElasticSampler(data), epoch=0, batch=0))

kvps's elastic jobs (`kvps launch --elastic`, docs/faults.md) need no reset when a worker dies: the
servers take it out of the rounds and the others go on without an error, so `run` syncs the state
from rank 0 once, at the start (as Horovod does), and then runs the function; a failure it cannot go
on from (a server lost without replicas, a job without --elastic) is raised as kvps raises it.
`commit()` keeps a copy of the state in memory and `restore()` goes back to it, as Horovod's do. A
worker that joins a running job in sync mode cannot get the others' current weights (they live on the
workers): its `sync()` raises a KVPSError that says so (kvps/torch/broadcast.py).
"""
import copy
import functools
import math

import torch

from kvps.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from kvps.torch.horovod import allgather_object, broadcast_object, rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's hvd.elastic.ElasticSampler: this worker's share of a dataset's indices for the
    epoch (every worker's shares are disjoint and cover the indices not yet processed this epoch,
    the last few repeated to even the shares), in an order shuffled by seed + epoch. The training
    loop records what it processed (record_batch, record_indices); TorchState keeps that with the
    state and, on sync, merges every worker's, so a job that goes on with other workers does not
    take those samples again this epoch. reset() shares the rest among the workers there are now."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices = set()
        self.indices = []
        self.reset()

    def set_epoch(self, epoch):
        """Start epoch `epoch` (with nothing processed), or, when it is the sampler's epoch already
        (a loop resumed mid-epoch from a synced state), go on with what is left of it."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Batch `batch_idx` of this epoch's iteration (batches of batch_size) was processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices):
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx, batch_size):
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.processed_indices = {int(i) for i in state["processed_indices"]}
        self.reset()

    def reset(self):
        """Share the indices not processed this epoch among the workers there are now."""
        left = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            order = torch.randperm(len(left), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            left = [left[i] for i in order.tolist()]
        workers = size()
        share = math.ceil(len(left) / workers)
        if left and len(left) < share * workers:
            left = (left * workers)[:share * workers]
        self.indices = left[rank()::workers]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class TorchState:
    """A model, an optimizer, ElasticSamplers and plain values (epoch, batch, ...) that elastic
    training keeps; the values and samplers are attributes (state.epoch, state.train_sampler)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._samplers = {name: v for name, v in kwargs.items() if isinstance(v, ElasticSampler)}
        self._values = {name: v for name, v in kwargs.items() if name not in self._samplers}
        self._callbacks = []
        self._saved = None
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def _current(self):
        return {name: getattr(self, name) for name in self._values}

    def save(self):
        """Keep a copy of the model's and the optimizer's state and of the values, in memory."""
        self._saved = (copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
                       copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                       copy.deepcopy(self._current()),
                       {name: sampler.state_dict() for name, sampler in self._samplers.items()})

    def restore(self):
        """Go back to the last save() or commit()."""
        model, optimizer, values, samplers = self._saved
        if self.model is not None:
            self.model.load_state_dict(model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        for name, value in copy.deepcopy(values).items():
            setattr(self, name, value)
        for name, state in samplers.items():
            self._samplers[name].load_state_dict(state)

    def sync(self):
        """Every worker takes rank 0's model, optimizer state and values (a collective)."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, value in broadcast_object(self._current(), root_rank=0).items():
            setattr(self, name, value)
        for name, sampler in self._samplers.items():
            # what any worker processed this epoch is processed (Horovod's sampler state handler)
            processed = set().union(*allgather_object(sorted(sampler.processed_indices), name=f"sampler/{name}"))
            epoch = broadcast_object(sampler.epoch, root_rank=0)
            sampler.load_state_dict({"epoch": epoch, "processed_indices": processed})
        self.save()

    def commit(self):
        """Horovod's commit: save(), then check for membership changes (kvps needs no check: a
        change is not an interruption here)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises HostsUpdatedInterrupt here when workers were added or removed; kvps's
        rounds take workers in and out by themselves, so nothing is interrupted."""

    def register_reset_callbacks(self, callbacks):
        self._callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._callbacks:
            callback()


def run(func):
    """Horovod's @hvd.elastic.run: sync the state from rank 0, then run func(state, ...)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper
