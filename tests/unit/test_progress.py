"""kvps/tools/progress.py: plain lines with an ETA where output is not a terminal, a rich bar where it is."""
import io

from kvps.tools.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_lines_with_an_eta_when_not_a_terminal():
    out, clock = io.StringIO(), Clock()
    with Progress(4, "runs", stream=out, clock=clock) as progress:
        assert progress.eta() is None
        for label in ("a", "b", "c", "d"):
            clock.now += 30
            progress.advance(label)
    lines = out.getvalue().splitlines()
    assert lines == ["[1/4] a (30s, about 1m30s left)", "[2/4] b (1m00s, about 1m00s left)",
                     "[3/4] c (1m30s, about 30s left)", "[4/4] d (2m00s)"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_on_a_terminal():
    out = Terminal()
    with Progress(2, "runs", stream=out) as progress:
        progress.advance("first")
        progress.advance("second")
    text = out.getvalue()
    assert "2/2" in text and "ETA" in text and "[1/2]" not in text


def test_without_with_the_bar_ends_at_the_last_item():
    out = Terminal()
    progress = Progress(2, "jobs", stream=out)
    progress.advance("one")
    assert progress._rich is not None
    progress.advance("two")
    assert progress._rich is None and "2/2" in out.getvalue()
    progress.close()                # twice is fine



def test_the_bar_leaves_stdout_alone_when_stdout_is_not_a_terminal(capsys):
    """`kvps experiment > log` with the bar on stderr: the command's own lines still reach the log."""
    out = Terminal()
    with Progress(2, "runs", stream=out) as progress:
        print("a table row")
        progress.advance("one")
        progress.advance("two")
    assert capsys.readouterr().out == "a table row\n" and "a table row" not in out.getvalue()


# ---- the commands that loop: kvps experiment over its runs, kvps emulate sync over its jobs ----
def test_experiment_shows_progress_over_its_runs(monkeypatch, capsys):
    import argparse

    from kvps.tools.experiment import cli, presets, runner

    specs = [presets.RunSpec("digits", mode, 2, 1, False, ("--steps", "5")) for mode in ("sync", "async")]
    answers = iter(["ok", "failed", "ok", "failed"])

    def fake_run(spec, **kwargs):               # no job: a result as runner.run returns one
        status = next(answers)
        return {"id": spec.id, "workload": spec.workload, "mode": spec.mode, "workers": spec.workers,
                "straggler": None, "net": spec.net, "status": status, "error": None if status == "ok" else "boom",
                "command": "python -m ...", "tail": [], "wall_s": 0.1, "points": [], "finals": []}

    monkeypatch.setattr(runner, "run", fake_run)
    monkeypatch.setattr(cli, "_say_done", lambda result, target: None)     # its summary needs real points
    results = {"targets": {"digits": 0.9}, "runs": [], "stragglers": []}
    args = argparse.Namespace(timeout=5.0, straggler_kind="fixed", straggler_delay=None)
    assert cli._run_all(specs, results, args, presets.PRESETS["tiny"], repeats=2) == cli.OK
    out, err = capsys.readouterr()
    assert "[experiment] (1/4) digits W=2 sync" in out and "[1/" not in out      # stdout as before
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split(" (")[0] for line in lines] == [
        "[1/4] digits/W2/sync/none/r0: ok", "[2/4] digits/W2/async/none/r0: failed",
        "[3/4] digits/W2/sync/none/r1: ok", "[4/4] digits/W2/async/none/r1: failed"]
    assert "left)" in lines[0] and "left)" not in lines[-1]


def test_emulate_sync_shows_progress_over_its_jobs(monkeypatch, capsys):
    import argparse

    from kvps.errors import NodeFailure
    from kvps.tools.emulate import sync

    def fake_setup(setup, args, plan_path):     # no namespaces: the first job's rows, the second fails
        if setup.servers == 2:
            raise NodeFailure("worker exit codes [1, 0]")
        return {"push+pull": {"mode": "push+pull", "ms": 12.0}, "pushpull": {"mode": "pushpull", "ms": 9.0}}

    monkeypatch.setattr(sync, "run_setup", fake_setup)
    args = argparse.Namespace(workload="1MB", steps=1, systems=["ps"], mxnet=None, compression=None,
                              rate="1gbit", delay_ms=0.0, mtu=1500, timeout=30.0, verbose=False)
    combos, _ = sync.shapes([2], [1, 2], ["dedicated"])
    assert sync.Benchmark(args, combos).run(1e9) == 1
    out, err = capsys.readouterr()
    assert "| kvps PS push+pull | 2 | 1 | dedicated | 12 |" in out and "[1/" not in out
    lines = [line.split(" (")[0] for line in err.splitlines() if line.startswith("[") and "/2]" in line]
    assert lines == ["[1/2] kvps PS W=2 S=1 dedicated: ok", "[2/2] kvps PS W=2 S=2 dedicated: failed"]
