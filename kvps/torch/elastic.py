"""Horovod's elastic API on kvps (`hvd.elastic.run`, `hvd.elastic.TorchState`), so a Horovod elastic
script runs with `import kvps.torch as hvd`:

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()
    train(hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0))

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

from kvps.torch.broadcast import broadcast_optimizer_state, broadcast_parameters
from kvps.torch.horovod import broadcast_object


class TorchState:
    """A model, an optimizer and plain values (epoch, batch, ...) that elastic training keeps; the
    values are attributes (state.epoch)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._values = dict(kwargs)
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
                       copy.deepcopy(self._current()))

    def restore(self):
        """Go back to the last save() or commit()."""
        model, optimizer, values = self._saved
        if self.model is not None:
            self.model.load_state_dict(model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        for name, value in copy.deepcopy(values).items():
            setattr(self, name, value)

    def sync(self):
        """Every worker takes rank 0's model, optimizer state and values (a collective)."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, value in broadcast_object(self._current(), root_rank=0).items():
            setattr(self, name, value)
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
