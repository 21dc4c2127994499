"""kvps/launch/restarts.py: which dead servers `kvps launch` replaces, when, and under what names;
no processes (tests/cluster/test_launch.py runs the real thing)."""
import io

import pytest

from kvps.errors import ConfigError
from kvps.launch.restarts import Restarts, node_of


def test_a_death_is_replaced_after_the_delay_in_the_order_of_the_deaths():
    plan = Restarts(budget=3, delay=2.5)
    assert plan.next_due() is None and plan.due(100.0) == []
    first = plan.died("S1", 10.0)
    assert (first.start_at, first.number) == (12.5, 1)
    second = plan.died("S0", 11.0)
    assert (second.start_at, second.number) == (13.5, 2)
    assert plan.next_due() == 12.5
    assert plan.due(12.4) == []                              # not yet: the scheduler still believes it alive
    assert plan.due(13.5) == [("S1", first), ("S0", second)]
    assert plan.due(20.0) == [] and plan.next_due() is None  # each is handed out once


def test_the_budget_bounds_the_replacements_of_the_whole_job():
    plan = Restarts(budget=2, delay=1.0)
    assert plan.died("S1", 0.0).number == 1
    plan.due(1.0)
    assert plan.died("S1", 5.0).number == 2                  # the replacement's own death counts the same
    refused = plan.died("S2", 6.0)
    assert refused.start_at is None and refused.number == 2
    assert refused.why == "no restarts left (--restart-servers 2)"
    assert Restarts(budget=1, delay=1.0).died("S0", 0.0).number == 1
    none = Restarts(budget=0, delay=1.0).died("S0", 0.0)
    assert none.start_at is None and none.why == "no restarts left (--restart-servers 0)"
    with pytest.raises(ConfigError, match="--restart-servers -1"):
        Restarts(budget=-1, delay=1.0)


def test_a_job_that_ends_drops_the_replacements_not_started():
    plan = Restarts(budget=5, delay=1.0)
    plan.died("S1", 0.0)
    plan.died("S2", 0.5)
    assert plan.cancel() == ["S1", "S2"]
    assert plan.next_due() is None and plan.due(10.0) == []


def test_replacements_get_child_names_of_their_own_that_map_back_to_the_node():
    plan = Restarts(budget=5, delay=1.0)
    assert [plan.child("S1"), plan.child("S1"), plan.child("S0")] == ["S1#2", "S1#3", "S0#2"]
    names = ("S1", "S1#2", "S12#3", "W0", "H", "launch")
    assert [node_of(n) for n in names] == ["S1", "S1", "S12", "W0", "H", "launch"]


def test_a_replacement_over_ssh_runs_on_its_nodes_host():
    from kvps.launch.ssh import Remote
    remote = Remote(["h0", "h1", "h2"], 2, "python3", "/work", {})
    assert [remote.host_of(n) for n in ("S1", "S1#2", "S0#3", "W0")] == ["h1", "h1", "h0", "h2"]


def test_a_replacements_output_keeps_its_nodes_prefix_and_the_flag_needs_replicas():
    from kvps.launch.job import Job, _under_node_names
    out = io.StringIO()
    write = _under_node_names(out)
    write("S1#2", "took over the ranges of S1")
    write("launch", "starting a replacement S1")
    assert out.getvalue() == "[S1] took over the ranges of S1\n[launch] starting a replacement S1\n"
    seen = []
    _under_node_names(lambda prefix, line: seen.append((prefix, line)))("S0#3", "x")
    assert seen == [("S0", "x")]
    with pytest.raises(ConfigError, match="--restart-servers 2 .* needs --replicas R"):
        Job(2, 2, ["python", "train.py"], env={"KVPS_REPLICAS": "0"}, restart_servers=2)
    with pytest.raises(ConfigError, match="--restart-servers -1: the number of replacements cannot be negative"):
        Job(2, 3, ["python", "train.py"], env={"KVPS_REPLICAS": "1"}, restart_servers=-1)
    job = Job(2, 3, ["python", "train.py"], env={"KVPS_REPLICAS": "1"})
    assert job.restart_servers == 3                          # the default: one per server
    job.stop()


def test_restarting_workers_needs_an_elastic_parameter_server_job():
    from kvps.launch.job import Job, judge
    with pytest.raises(ConfigError, match="--restart-workers 1 .* needs --elastic"):
        Job(2, 1, ["python", "train.py"], env={"KVPS_ELASTIC": "0"}, restart_workers=1)
    with pytest.raises(ConfigError, match="needs --elastic .* and -s 1 or more"):
        Job(2, 0, ["python", "train.py"], env={"KVPS_ELASTIC": "1"}, restart_workers=1)    # a ring job ends
    with pytest.raises(ConfigError, match="--restart-workers -1: the number of replacements cannot be negative"):
        Job(2, 1, ["python", "train.py"], env={"KVPS_ELASTIC": "1"}, restart_workers=-1)
    plan = Restarts(1, 3.0, "--restart-workers")
    assert plan.died("W1", 0.0).start_at == 3.0 and plan.died("W2", 1.0).why == "no restarts left (--restart-workers 1)"
    describe = lambda name, code: f"{name} exited with code {code}"      # noqa: E731
    assert judge("W1", 137, True, describe, elastic=True) is None        # the others go on
    assert judge("W1", 1, False, describe, elastic=True) == "worker W1 exited with code 1; stopping the job"
    assert judge("W1", 1, True, describe) == "worker W1 exited with code 1; stopping the job"


class _Ended:
    """A Supervisor whose workers have all ended, W1 failing, when the job first looks: the exits
    wait in its queue in the order they came."""

    def __init__(self, exits):
        self.procs = {name: None for name, _ in exits}
        self._exits, self._codes, self.said = list(exits), dict(exits), []

    def running(self, names=None):
        return []

    def wait_any(self, timeout):
        return self._exits.pop(0) if self._exits else None

    def wait(self, timeout, names=None):
        return {}

    def poll(self):
        return dict(self._codes)

    def stop(self):
        pass

    def emit(self, prefix, text):
        self.said.append(text)


def test_a_worker_that_fails_as_the_others_end_still_fails_the_job():
    """The last workers can end at once: the launcher's loop stops when none runs, and a failure
    still in the queue of exits gives the job its code (it once gave 0)."""
    from kvps.launch.job import Job
    job = Job(3, 1, ["python", "train.py"])
    job.children = _Ended([("W0", 0), ("W1", 1), ("W2", 0), ("S0", 0)])
    assert job.wait() == 1 and job.children.said == ["worker W1 exited with code 1; stopping the job"]
    job.children = _Ended([("W0", 0), ("W1", 0), ("W2", 0)])
    assert job.wait() == 0 and job.children.said == []
