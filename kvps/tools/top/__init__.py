"""`kvps top HOST:PORT`: a live terminal view (rich) of a running job, from its metrics.

    KVPS_METRICS_PORT=0 kvps launch -n 2 -s 2 -- python train.py   # or --metrics; [H] prints METRICS HOST:PORT
    kvps top 127.0.0.1:9100                     # that address: the scheduler's /metrics and /targets
    kvps top 127.0.0.1:9100 --once              # one table, printed, then exit (scripts, CI logs)

One row per node: its state (from the scheduler), messages/s, MB/s (in and out), and for workers the
mean kvstore call time and calls/s, for servers the mean sync round time, the mean staleness of
applied pushes and the busiest key (in 80 columns). Above it: the slowest worker, the hottest server and its
hottest key. Refreshes every --interval seconds until Ctrl-C or the job ends (its /targets stops
answering: exit 0 if it was ever seen, else 2). Reading is kvps/tools/top/snapshot.py.
"""
import argparse
import sys
import time

from kvps.tools.top.snapshot import Reader


def _num(value, fmt="{:.1f}"):
    return "-" if value is None else fmt.format(value)


def render(view, address):
    """The rich renderable of one View."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    if view.error:
        return Text(f"kvps top {address}: {view.error}", style="red")
    head = Text.assemble(
        ("kvps top ", "bold"), address, "\n",
        ("slowest worker: ", "bold"), view.slowest_worker or "-", "   ",
        ("hottest server: ", "bold"), view.hottest_server or "-", "   ",
        ("hottest key: ", "bold"), (view.hottest_key or "-")[:24])
    # fits 80 columns: an operator's terminal, a CI log, a tmux pane
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
    for column, width in (("node", 4), ("state", 5), ("msg/s", 5), ("MB/s", 5), ("call/s", 6), ("call ms", 7),
                          ("round ms", 8), ("stale", 5), ("busiest key", 11)):
        table.add_column(column, justify="left" if column in ("node", "state", "busiest key") else "right",
                         no_wrap=True, min_width=width, max_width=max(width, 16), overflow="ellipsis")
    for n in view.nodes:
        style = None if n.state == "alive" else "yellow"
        table.add_row(n.name, n.state, _num(n.msgs_per_s, "{:.0f}"),
                      _num((n.in_bytes_per_s + n.out_bytes_per_s) / 1e6, "{:.2f}"), _num(n.calls_per_s),
                      _num(n.call_ms, "{:.2f}"), _num(n.round_ms, "{:.2f}"), _num(n.staleness, "{:.2f}"),
                      n.top_key or "-", style=style)
    stamp = Text(time.strftime("%H:%M:%S", time.localtime(view.at)) + "  (Ctrl-C to quit)", style="dim")
    return Group(head, table, stamp)


def parser():
    p = argparse.ArgumentParser(prog="kvps top", description="a live view of a running kvps job")
    p.add_argument("address", help="the scheduler's metrics HOST:PORT (its METRICS line; KVPS_METRICS_PORT)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one table (after one interval, for rates) and exit")
    return p


def main(argv=None):
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.interval <= 0:
        print(f"kvps top: error: --interval {args.interval} must be positive", file=sys.stderr)
        return 2
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        print("kvps top: error: it needs rich (pip install rich)", file=sys.stderr)
        return 2
    reader = Reader(args.address)
    console = Console()
    view = reader.read()
    seen = view.error is None
    if args.once:
        if seen:
            time.sleep(args.interval)
            view = reader.read()
        console.print(render(view, args.address))
        return 0 if view.error is None else 2
    try:
        with Live(render(view, args.address), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(args.interval)
                view = reader.read()
                if view.error is not None and seen:
                    live.update(render(view, args.address))
                    return 0            # the job has ended
                seen = seen or view.error is None
                live.update(render(view, args.address))
    except KeyboardInterrupt:
        return 0
