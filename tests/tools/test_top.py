"""`kvps top` the way a user runs it: a job started with `kvps launch --metrics` (which prints every
node's metrics address), and `kvps top` in a terminal (tmux, on a socket of this test's own); the
test reads the screen until it shows every node alive, rates, the slowest worker and the hottest
server and key. Then --once, for scripts, and the errors."""
import os
import re
import signal
import subprocess
import time

from kvps.tools.top import main as top_main
from tests.harness import FAST_ENV, PY, program_or_skip, run_command, wait_for

WORKER = """
import os, pathlib, time
import numpy as np, kvps
kv = kvps.create("dist_async")
w = np.zeros(4000, np.float32)
kv.init("hot", w)
kv.init("cold", np.zeros(10, np.float32))
done = pathlib.Path(os.environ["DONE_FILE"])
deadline = time.monotonic() + 60
while not done.exists() and time.monotonic() < deadline:
    kv.push("hot", np.ones(4000, np.float32))
    kv.pull("hot", out=w)
    time.sleep(0.005 if kv.rank == 0 else 0.03)       # W1 is the slow one
kv.close()
"""


def tmux_binary():
    return program_or_skip("tmux", "tmux", timeout=300)


def test_top_shows_a_job_launched_with_metrics(tmp_path):
    tmux = tmux_binary()
    done = tmp_path / "done"
    (tmp_path / "worker.py").write_text(WORKER)
    socket = f"kvps-top-test-{os.getpid()}"           # our own tmux server: nobody else's sessions
    log = tmp_path / "launch.log"
    env = dict(os.environ, **FAST_ENV, DONE_FILE=str(done))
    env.pop("KVPS_METRICS_PORT", None)
    launch = subprocess.Popen([PY, "-m", "kvps.cli", "launch", "--metrics", "-n", "2", "-s", "2", "--",
                               PY, str(tmp_path / "worker.py")], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              cwd=tmp_path, env=env)
    try:
        def node_lines():
            return re.findall(r"^\[H\] METRICS ([HSW]\d*) ?(\S+)$", log.read_text(), re.M)
        wait_for(lambda: len(node_lines()) == 4, 60, "kvps launch --metrics to print the nodes' addresses")
        address = re.search(r"^\[H\] METRICS (\S+) \(Prometheus", log.read_text(), re.M).group(1)
        assert sorted(n for n, _ in node_lines()) == ["S0", "S1", "W0", "W1"]
        assert re.search(r"^\[S0\] READY \S+ metrics=127\.0\.0\.1:\d+$", log.read_text(), re.M), log.read_text()

        subprocess.run([tmux, "-L", socket, "new-session", "-d", "-s", "top", "-x", "100", "-y", "30",
                        f"{PY} -m kvps.cli top {address} --interval 0.5"], check=True, timeout=30)
        screen = [""]

        def shows_the_job():
            screen[0] = subprocess.run([tmux, "-L", socket, "capture-pane", "-p", "-t", "top"],
                                       capture_output=True, text=True, timeout=10).stdout
            rows = {line.split()[0]: line.split() for line in screen[0].splitlines()
                    if line.split() and line.split()[0] in ("H", "S0", "S1", "W0", "W1")}
            return (len(rows) == 5 and all(r[1] == "alive" for r in rows.values())
                    and "slowest worker: W1" in screen[0] and "hottest key: hot" in screen[0])
        try:
            wait_for(shows_the_job, 60, "kvps top to show the job")
        except AssertionError:
            raise AssertionError(f"kvps top's screen:\n{screen[0]}\n{log.read_text()[-3000:]}") from None
        assert "hottest server: S" in screen[0] and "msg/s" in screen[0]
        once = run_command([PY, "-m", "kvps.cli", "top", address, "--once", "--interval", "0.3"], tmp_path, 60)
        assert once.returncode == 0 and "W0" in once.stdout and "S1" in once.stdout, once.stdout + once.stderr
        done.write_text("ok")
        assert launch.wait(60) == 0, log.read_text()[-3000:]
    finally:
        done.write_text("ok")
        subprocess.run([tmux, "-L", socket, "kill-server"], capture_output=True, timeout=30)
        if launch.poll() is None:           # the launcher stops its own children on SIGTERM
            launch.send_signal(signal.SIGTERM)
            try:
                launch.wait(30)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait(10)


def test_top_reports_a_job_it_cannot_reach_and_a_bad_interval(capsys):
    started = time.monotonic()
    assert top_main(["127.0.0.1:1", "--once"]) == 2
    assert "cannot read http://127.0.0.1:1/targets" in capsys.readouterr().out
    assert top_main(["127.0.0.1:1", "--interval", "0"]) == 2
    assert "--interval 0.0 must be positive" in capsys.readouterr().err
    assert time.monotonic() - started < 10
