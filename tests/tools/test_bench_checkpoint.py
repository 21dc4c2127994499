"""`kvps bench checkpoint` end to end on a tiny state: it runs, and prints its table with the copy
baseline and the ratios (speed itself is the benchmark's to report, not a test's)."""
import sys

from harness import run_command


def test_bench_checkpoint_prints_its_table(tmp_path):
    result = run_command([sys.executable, "-m", "kvps.cli", "bench", "checkpoint", "--mb", "2", "--keys", "2",
                          "--repeat", "1", "--dir", str(tmp_path)], tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| kv.")]
    assert [r.split("|")[1].strip() for r in rows] == ["kv.save", "kv.load"], result.stdout
    assert all(r.rstrip(" |").endswith("x") for r in rows), result.stdout
    assert list(tmp_path.iterdir()) == []         # its files are gone
