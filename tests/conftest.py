import pytest

from harness import Cluster


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
