"""Test tiers: each folder is one tier and gets that pytest marker, so `pytest -m unit` runs the fast one.

    unit/      the library in process, no sockets to other processes (under a minute)
    kernels/   the compute kernels of every backend against the numpy reference
    cluster/   real scheduler, server and worker processes on 127.0.0.1
    tools/     kvps bench, emulate and experiment, end to end
    fuzz/      hostile frames (hypothesis) at real daemons, then a real job (well under a minute)
    gpu/       CUDA kernels on a GPU (skipped without one)
"""
import pathlib

import pytest

from harness import Cluster

TIERS = ("unit", "kernels", "cluster", "tools", "fuzz", "gpu")
HERE = pathlib.Path(__file__).parent


def pytest_configure(config):
    # Run in the background (`./run test &` in a script), pytest inherits SIGINT ignored, and so
    # would every process a test starts: the tests of Ctrl-C would then fail. As kvps's commands do.
    from kvps.cli import hear_interrupts
    hear_interrupts()


def pytest_collection_modifyitems(items):
    for item in items:
        tier = pathlib.Path(item.fspath).relative_to(HERE).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def cluster(tmp_path):
    """cluster(workers, servers, **kw) starts a Cluster that is stopped after the test."""
    made = []

    def make(workers, servers, **kw):
        c = Cluster(tmp_path / f"c{len(made)}", workers, servers, **kw)
        c.dir.mkdir()
        made.append(c)
        return c.start()
    yield make
    for c in made:
        c.close()
