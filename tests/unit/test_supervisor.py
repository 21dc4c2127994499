"""kvps.supervisor on real child processes (small `python -c` scripts, each test well under a second):
the READY line, output with a prefix, to a callback or a file, exit codes, deadlines, and stopping
by pid, process groups included, with nothing left behind."""
import io
import os
import signal
import sys
import time

import pytest

from kvps.errors import ConfigError, KVTimeoutError
from kvps.supervisor import Supervisor, exit_code

PY = sys.executable
GRACE = 0.3


def script(*lines):
    return [PY, "-c", "\n".join(lines)]


def gone(pid, timeout=2.0):
    """True once `pid` has exited (a zombie that init has not reaped yet counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def out():
    return io.StringIO()


def test_ready_gives_the_address_and_output_comes_prefixed(out):
    with Supervisor(out) as sup:
        sup.spawn("H", script("print('starting')", "print('READY 127.0.0.1:4242')", "print('done')"), ready=True)
        assert sup.ready("H", 5) == "127.0.0.1:4242"
        assert sup.wait_any(5) == ("H", 0)
    assert out.getvalue() == "[H] starting\n[H] done\n"         # the READY line is the supervisor's
    assert sup.tail("H") == ["starting", "done"]


def test_a_child_that_exits_before_ready_is_named_with_its_output(out):
    with Supervisor(out) as sup:
        sup.spawn("S0", script("import sys", "print('no such plugin: x')", "sys.exit(3)"), ready=True)
        with pytest.raises(KVTimeoutError, match=r"(?s)S0 exited before it printed READY \(exit code 3\).*"
                                                 r"no such plugin: x"):
            sup.ready("S0", 5)


def test_ready_has_a_deadline():
    with Supervisor() as sup:
        sup.spawn("H", script("import time", "print('thinking', flush=True)", "time.sleep(30)"), ready=True)
        start = time.monotonic()
        with pytest.raises(KVTimeoutError, match=r"H did not print READY within 0.2 s \(running\)"):
            sup.ready("H", 0.2)
        assert time.monotonic() - start < 1.0
        sup.stop(GRACE)
        assert sup.poll() == {"H": -signal.SIGTERM}


def test_callback_log_file_and_separate_stderr(tmp_path):
    seen = []
    sup = Supervisor(lambda name, line: seen.append((name, line)))
    sup.spawn("W0", script("import sys", "print('out 1')", "print('err 1', file=sys.stderr)", "print('out 2')"),
              log=tmp_path / "W0.log", stderr=tmp_path / "W0.err")
    sup.spawn("W1", script("import sys", "print('both', file=sys.stderr)"))          # merged into its output
    assert sup.wait(5) == {"W0": 0, "W1": 0}
    sup.stop()
    assert [line for name, line in seen if name == "W0"] == ["out 1", "out 2"]
    assert ("W1", "both") in seen
    assert (tmp_path / "W0.log").read_text() == "out 1\nout 2\n"
    assert (tmp_path / "W0.err").read_text() == "err 1\n"


def test_wait_any_reports_each_exit_once_with_its_code():
    with Supervisor() as sup:
        sup.spawn("W0", script("import sys", "sys.exit(7)"))
        sup.spawn("W1", script("import os, signal", "os.kill(os.getpid(), signal.SIGKILL)"))
        got = dict(sup.wait_any(5) for _ in range(2))
        assert got == {"W0": 7, "W1": -signal.SIGKILL}
        assert sup.wait_any(0.05) is None and sup.running() == []
    assert exit_code(-signal.SIGKILL) == 128 + signal.SIGKILL and exit_code(7) == 7


def test_wait_has_a_deadline_and_says_who_still_runs():
    with Supervisor() as sup:
        sup.spawn("W0", script("pass"))
        sup.spawn("W1", script("import time", "time.sleep(30)"))
        start = time.monotonic()
        assert sup.wait(0.5) == {"W0": 0, "W1": None}
        assert time.monotonic() - start < 1.0
        assert sup.running() == ["W1"] and sup.wait_any(1) == ("W0", 0)
        sup.stop(GRACE)


def test_stop_escalates_to_sigkill_and_takes_the_childs_group_with_it():
    # The child ignores SIGTERM and leaves a grandchild in its process group.
    sup = Supervisor()
    sup.spawn("W0", script("import signal, subprocess, time", "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                           "p = subprocess.Popen(['sleep', '30'])", "print(f'READY {p.pid}', flush=True)",
                           "time.sleep(30)"), ready=True)
    grandchild = int(sup.ready("W0", 5))
    start = time.monotonic()
    sup.stop(GRACE)
    assert GRACE <= time.monotonic() - start < GRACE + 1.0
    assert sup.poll() == {"W0": -signal.SIGKILL}
    assert gone(grandchild)


def test_a_child_asked_alone_stops_and_what_it_left_is_killed():
    # As kvps experiment stops `kvps launch`: SIGINT to the launcher alone, then its group goes.
    sup = Supervisor()
    sup.spawn("launch", script("import subprocess, sys, time", "p = subprocess.Popen(['sleep', '30'])",
                               "try:\n    print(f'READY {p.pid}', flush=True)\n    time.sleep(30)\n"
                               "except KeyboardInterrupt:\n    sys.exit(130)"), ready=True)
    grandchild = int(sup.ready("launch", 5))
    sup.stop(5.0, signal.SIGINT, group=False)
    assert sup.poll() == {"launch": 130}
    assert gone(grandchild)


def test_a_child_that_exited_leaves_nothing_behind_after_stop():
    sup = Supervisor()
    sup.spawn("W0", script("import subprocess", "p = subprocess.Popen(['sleep', '30'])", "print(p.pid)"))
    assert sup.wait(5) == {"W0": 0}
    grandchild = int(sup.tail("W0")[0])
    assert not gone(grandchild, timeout=0.05)       # still running: its group outlived the child
    sup.stop(GRACE)
    assert gone(grandchild)


def test_children_without_a_session_share_ours_and_are_stopped_by_pid():
    with Supervisor(new_session=False) as sup:
        proc = sup.spawn("W0", script("import os", "print(os.getpgid(0), flush=True)", "import time",
                                      "time.sleep(30)"))
        assert sup.wait(0.1) == {"W0": None}
        deadline = time.monotonic() + 5
        while not sup.tail("W0") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(sup.tail("W0")[0]) == os.getpgid(0)
        sup.stop(GRACE)
    assert proc.returncode == -signal.SIGTERM         # reaped: its Popen knows


def test_bad_names_and_commands_are_refused():
    with Supervisor() as sup:
        sup.spawn("W0", script("pass"))
        with pytest.raises(ConfigError, match="'W0' was already started"):
            sup.spawn("W0", script("pass"))
        with pytest.raises(ConfigError, match="no command"):
            sup.spawn("W1", [])
        with pytest.raises(ConfigError, match=r"no child named 'W9' \(children: W0\)"):
            sup.ready("W9")
        with pytest.raises(ConfigError, match="not spawned with ready=True"):
            sup.ready("W0")
        with pytest.raises(FileNotFoundError):
            sup.spawn("W2", ["/no/such/program"])
        assert list(sup.procs) == ["W0"]
