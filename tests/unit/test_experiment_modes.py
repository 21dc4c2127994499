"""`kvps experiment`'s mode names (GEO-SGD, compression), the cells the presets plan for them, the
Logbook's GEO bookkeeping, and the findings and plots that compare them: pure units, no processes."""
import io
import json

import pytest

from kvps.ps.consistency import Consistency
from kvps.tools.experiment import cli, findings, logbook, metrics, presets, report, runner


# ---- mode names ----
@pytest.mark.parametrize("mode, kvstore, family, param, compression", [
    ("sync", "dist_sync", "sync", None, None),
    ("async", "dist_async", "async", None, None),
    ("ssp:4", "dist_ssp:4", "ssp", 4, None),
    ("ssp:inf", "dist_ssp:inf", "ssp", "inf", None),
    ("backup:1", "dist_sync:backup=1", "backup", 1, None),
    ("allreduce", "allreduce", "allreduce", None, None),
    ("geo:1", "dist_geo:1", "geo", 1, None),
    ("geo:16", "dist_geo:16", "geo", 16, None),
    ("sync+2bit", "dist_sync", "sync", None, {"type": "2bit"}),
    ("sync+2bit+pull", "dist_sync", "sync", None, {"type": "2bit", "pull": True}),
    ("sync+2bit:0.05+pull", "dist_sync", "sync", None, {"type": "2bit", "threshold": 0.05, "pull": True}),
    ("async+fp16+pull", "dist_async", "async", None, {"type": "fp16", "pull": True}),
    ("geo:4+bf16", "dist_geo:4", "geo", 4, {"type": "bf16"}),
    ("ssp:2+topk:0.1", "dist_ssp:2", "ssp", 2, {"type": "topk", "ratio": 0.1}),
    ("backup:1+1bit:0", "dist_sync:backup=1", "backup", 1, {"type": "1bit", "threshold": 0.0}),
])
def test_parse_mode(mode, kvstore, family, param, compression):
    m = presets.parse_mode(mode)
    assert (m.kvstore, m.family, m.param, m.compression) == (kvstore, family, param, compression)
    assert presets.kvstore_type(mode) == kvstore
    assert m.base == mode.partition("+")[0]
    if compression is None:
        assert m.script_args == ()
    else:
        flag, text = m.script_args
        assert flag == "--compression" and json.loads(text) == compression and " " not in text


@pytest.mark.parametrize("bad, words", [
    ("geo", "is not one of"), ("geo:0", "is not one of"), ("geo:-1", "is not one of"), ("geo:x", "is not one of"),
    ("sync+", "is not one of"), ("sync+gzip", "is not one of"), ("sync+pull", "is not one of"),
    ("sync+fp16:2", "is not one of"), ("sync+fp16+pull+pull", "is not one of"), ("sync+fp16+push", "is not one of"),
    ("+fp16", "is not one of"), ("sync+2bit:x", "'x' is not a number"), ("sync+2bit:0", "threshold"),
    ("sync+topk:2", "ratio"), ("allreduce+fp16", "the ring sends values as they are"),
])
def test_parse_mode_refuses_bad_names(bad, words):
    with pytest.raises(ValueError, match=words) as info:
        presets.parse_mode(bad)
    assert repr(bad) in str(info.value)


def test_mode_help_lists_the_new_modes():
    for text in ("geo:K", "+pull", "sync+2bit", "sync+fp16+pull", "topk"):
        assert text in presets.MODE_HELP


def test_check_modes_and_servers():
    presets.check_modes(["geo:4", "sync+2bit+pull", "backup:1+fp16"], [2, 4])
    with pytest.raises(ValueError, match="needs more than 2 workers"):
        presets.check_modes(["backup:2+fp16"], [2])
    assert presets.servers_for("geo:4", 2) == 2 and presets.servers_for("sync+fp16", 1) == 1
    assert presets.servers_for("allreduce", 2) == 0


def test_the_mode_puts_compression_on_the_script_command():
    spec = presets.plan(presets.PRESETS["tiny"], modes=["sync+fp16+pull", "geo:4"], stragglers=(False,))
    argv = runner.command(spec[0])
    i = argv.index("--kvstore")
    assert argv[i:i + 4] == ["--kvstore", "dist_sync", "--compression", '{"type":"fp16","pull":true}']
    assert argv[i + 4:] == list(spec[0].args)
    shown = runner.shown_command(argv)
    assert shown.endswith("""--compression '{"type":"fp16","pull":true}' --steps 60 --eval-every 20""")
    assert runner.command(spec[1])[i:i + 3] == ["--kvstore", "dist_geo:4", "--steps"]


# ---- what the presets run ----
def _cells(specs):
    return [(s.workload, s.workers, s.mode, s.straggler) for s in specs]


def test_full_preset_runs_geo_and_compression_on_digits_only():
    specs = presets.plan(presets.PRESETS["full"])
    digits = {(s.mode, s.straggler) for s in specs if s.workload == "digits" and s.workers == 2}
    for k in (1, 4, 16):                     # GEO beside sync and async, with and without the straggler
        assert {(f"geo:{k}", False), (f"geo:{k}", True)} <= digits
    assert {("sync", False), ("sync", True), ("async", False), ("async", True)} <= digits
    packed = {m for m, _ in digits if "+" in m}
    assert packed == {"sync+fp16", "sync+fp16+pull", "sync+2bit", "sync+2bit+pull"}
    assert not [m for m, straggled in digits if straggled and "+" in m]      # compression: no straggler
    sparse = {s.mode for s in specs if s.workload == "sparse"}
    assert sparse == set(presets.FULL_MODES)
    assert {s.workers for s in specs} == {2, 4}
    assert len(specs) == 2 * (len(digits) + 2 * len(presets.FULL_MODES))


def test_quick_and_tiny_presets_do_not_grow():
    """./run demo is the quick preset: the new modes stay out of it (and out of the tiny one)."""
    assert _cells(presets.plan(presets.PRESETS["quick"])) == [
        ("digits", 3, m, s) for m, s in (("sync", False), ("async", False), ("ssp:4", False), ("allreduce", False),
                                         ("sync", True), ("async", True), ("backup:1", True))]
    assert len(presets.plan(presets.PRESETS["tiny"])) == 8


@pytest.mark.parametrize("preset", ["tiny", "quick", "full"])
def test_explicit_geo_modes_run_on_any_preset(preset):
    specs = presets.plan(presets.PRESETS[preset], workloads=["digits"], modes=["sync", "async", "geo:4"],
                         workers=[2], stragglers=(False,))
    assert [s.mode for s in specs] == ["sync", "async", "geo:4"] and specs[2].kvstore == "dist_geo:4"


def test_a_workload_without_the_path_is_skipped_and_said():
    full = presets.PRESETS["full"]
    specs = presets.plan(full, modes=["sync", "geo:4", "sync+fp16"], workers=[2], stragglers=(False,))
    assert _cells(specs) == [("digits", 2, "sync", False), ("digits", 2, "geo:4", False),
                             ("digits", 2, "sync+fp16", False), ("sparse", 2, "sync", False)]
    why = presets.skipped(full.workloads, ["sync", "geo:4", "sync+fp16"])
    assert [(w, m) for w, m, _ in why] == [("sparse", "geo:4"), ("sparse", "sync+fp16")]
    assert "no geo path" in why[0][2] and "--compression" in why[1][2]
    # nothing left at all: no calibration run either
    assert presets.plan(full, workloads=["sparse"], modes=["geo:4"], workers=[2]) == []


def test_cli_refuses_a_grid_with_nothing_to_run(tmp_path, capsys):
    code = cli.main(["--workloads", "sparse", "--modes", "geo:4", "--out", str(tmp_path)])
    assert code == cli.USAGE and "nothing to run: sparse geo:4: sparse has no geo path" in capsys.readouterr().err
    assert cli.main(["--modes", "geo:0", "--out", str(tmp_path)]) == cli.USAGE
    assert not (tmp_path / "report.md").exists()


# ---- the Logbook under GEO ----
class FakeKV:
    """What the Logbook reads of a kvstore; `pushes` plays the servers' counter."""

    def __init__(self, kvstore, workers=1):
        mode, _, k = kvstore.partition(":")
        self.type, self.rank, self.num_workers = kvstore, 0, workers
        self.consistency = Consistency("geo", k_steps=int(k)) if mode == "dist_geo" else Consistency(mode[5:])
        self.pushes, self.joined = 0, False

    def server_stats(self):
        return {"S0": {"pushes": self.pushes, "dropped": 0, "joins": 0, "staleness": [self.pushes]}}

    def join(self):
        self.joined = True


def _lines(out):
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_logbook_geo_evaluates_after_syncs_and_stops_after_one():
    kv, out = FakeKV("dist_geo:4"), io.StringIO()
    book = logbook.Logbook(kv, nkeys=2, eval_every="3", out=out)
    assert book.sync_every == 4
    merged = []
    book.start()
    while book.training(steps=6):            # W = 1: 6 steps, rounded up to the next sync
        book.stepped()
        if book.steps % 4 == 0:
            kv.pushes += 2                   # a sync pushes both keys
        if book.due():
            book.point(loss=1.0, accuracy=0.5)
    assert book.steps == 8 and book.stopped == "steps"
    book.finish(lambda: book.point(loss=0.5, accuracy=0.9), merge=lambda: merged.append(book.steps))
    lines = _lines(out)
    points = [p for p in lines if p["event"] == "point"]
    # due at steps 3 and 6, each evaluated at the next sync; the merged weights once more at the end
    assert [p["step"] for p in points] == [4, 8, 8] and points[-1]["accuracy"] == 0.9
    assert [p["updates"] for p in points] == [4, 8, 8]            # K x pushes per key: every local step
    assert merged == [8] and kv.joined and lines[-1]["event"] == "final" and lines[-1]["steps"] == 8


def test_logbook_counts_pushes_as_gradients_outside_geo():
    kv = FakeKV("dist_async", workers=2)
    kv.pushes = 10
    book = logbook.Logbook(kv, nkeys=2, out=io.StringIO())
    assert book.sync_every == 1 and book.updates() == 5
    geo = FakeKV("dist_geo:16", workers=2)
    geo.pushes = 10
    assert logbook.Logbook(geo, nkeys=2, out=io.StringIO()).updates() == 80
    assert logbook.sync_every(FakeKV("dist_geo:1")) == 1 and logbook.sync_every(object()) == 1


def test_logbook_steps_points_are_unchanged_outside_geo():
    kv, out = FakeKV("dist_sync"), io.StringIO()
    book = logbook.Logbook(kv, nkeys=1, eval_every="3", out=out)
    book.start()
    while book.training(steps=7):
        book.after_step(lambda: book.point(loss=1.0, accuracy=0.5))
    book.finish(lambda: book.point(loss=1.0, accuracy=0.5))
    assert [p["step"] for p in _lines(out) if p["event"] == "point"] == [3, 6, 7]


# ---- findings and plots ----
def _run(mode, k, reach_time, accuracy, step_ms, straggler=False):
    pts = [{"time": reach_time / 2, "updates": 100, "step": 50, "loss": 0.5, "accuracy": 0.9},
           {"time": reach_time, "updates": 200, "step": 100, "loss": 0.2, "accuracy": accuracy}]
    cell = f"digits/W2/{mode}/{'straggler' if straggler else 'none'}"
    return {"id": f"{cell}/r{k}", "cell": cell, "workload": "digits", "mode": mode, "workers": 2, "status": "ok",
            "error": None, "straggler": None, "net": "local", "points": pts,
            "finals": [{"rank": 0, "steps": 100, "step_ms": step_ms}],
            "server": {"pushes": 400, "dropped": 0, "staleness": [400]}, "tail": [], "command": "kvps launch ..."}


def _repeats(mode, times, accuracy, step_ms):
    return [_run(mode, k, t, accuracy, step_ms) for k, t in enumerate(times)]


def test_findings_compare_compression_with_its_plain_mode_and_explain_geo():
    runs = (_repeats("sync", [1.0, 1.1, 0.9], 0.96, 2.0) + _repeats("sync+fp16+pull", [1.05, 1.2, 0.95], 0.96, 2.6)
            + _repeats("sync+2bit+pull", [3.0, 3.1, 3.2], 0.94, 2.5) + _repeats("geo:4", [0.4, 0.5, 0.45], 0.96, 0.5))
    texts = [f["text"] for f in findings.findings(runs, {"digits": 0.95})]
    effect = next(t for t in texts if "gradient compression against the same mode" in t)
    assert ("sync+fp16+pull time to target 1.05 s (0.95 s to 1.20 s) / 1.00 s (0.90 s to 1.10 s), final accuracy "
            "0.960 / 0.960, step 2.60 ms / 2.00 ms (no clear difference in time; no clear difference in accuracy; "
            "step: longer)") in effect
    assert "sync+2bit+pull time to target not reached / 1.00 s (0.90 s to 1.10 s)" in effect
    assert "final accuracy 0.940 / 0.960, step 2.50 ms / 2.00 ms (time: slower; accuracy: lower; step: longer)." \
        in effect
    assert "median of 3 runs" in effect
    race = next(t for t in texts if "time to 95%" in t)
    assert race.startswith("digits, W=2, no straggler: time to 95% test accuracy (median of 3 runs")
    assert "fastest first: geo:4 0.45 s (0.40 s to 0.50 s); then" in race
    assert "not reached in most runs: sync+2bit+pull (final accuracy 0.940)" in race
    for t in texts:
        if "gradients applied" in t:
            assert "under geo:4 a gradient is one worker's local step" in t
    # one run each: no verdicts, and the sentence says why
    single = [r for r in runs if r["id"].endswith("/r0")]
    effect = next(f["text"] for f in findings.findings(single, {"digits": 0.95}) if "compression against" in f["text"])
    assert "one run each, so no intervals" in effect and "no clear difference in" not in effect


def test_no_compression_sentence_without_the_plain_twin():
    runs = _repeats("sync+fp16", [1.0], 0.96, 2.0) + _repeats("async", [1.0], 0.96, 2.0)
    assert not [f for f in findings.findings(runs, {"digits": 0.95}) if "compression against" in f["text"]]


def test_focus_plots_pick_the_comparisons_and_their_baselines():
    def cells_of(*modes):
        return [[_run(m, 0, 1.0, 0.96, 2.0)] for m in modes]
    picked = dict(report._focus(cells_of("sync", "async", "ssp:4", "geo:1", "geo:4", "sync+fp16", "async+fp16+pull")))
    assert [r[0]["mode"] for r in picked["geo"]] == ["sync", "async", "geo:1", "geo:4"]
    assert [r[0]["mode"] for r in picked["compression"]] == ["sync", "async", "sync+fp16", "async+fp16+pull"]
    assert report._focus(cells_of("sync", "async", "geo:4")) == []        # the whole plot already
    assert report._focus(cells_of("sync", "ssp:4")) == []


def test_report_says_what_geo_and_compression_mean_and_what_was_skipped():
    runs = _repeats("sync", [1.0], 0.96, 2.0) + _repeats("geo:4", [0.5], 0.96, 0.5)
    results = {"preset": "full", "started": "now", "machine": "m", "command": "kvps experiment", "wall_s": 1.0,
               "targets": {"digits": 0.95}, "workloads": {"digits": "d"},
               "modes": {"sync": "dist_sync", "geo:4": "dist_geo:4",
                         "sync+fp16+pull": """dist_sync --compression '{"type":"fp16","pull":true}'"""},
               "skipped": [["sparse", "geo:4", "sparse has no geo path"]], "workers": [2], "servers": 1,
               "runs": runs, "stragglers": [], "findings": findings.findings(runs, {"digits": 0.95})}
    text = report.markdown(results)
    assert "GEO-SGD (`geo:K`)" in text and "Compression (`MODE+CODEC`, `+pull`)" in text
    assert "* Skipped: sparse geo:4: sparse has no geo path." in text
    assert "| geo:4 | no | loopback | 1/1 | 0.50 s | 200 |" in text
    assert metrics.show_interval("time_to_target", metrics.cells(runs, {"digits": 0.95})[1]["time_to_target"]) == \
        "0.50 s"
