"""Progress of a long command (`kvps bench`, `kvps experiment`, `kvps emulate`): a bar with an ETA
on a terminal (rich), plain lines where output is not a terminal, so CI logs stay readable.

    with Progress(total=20, what="runs") as progress:
        for spec in specs:
            run(spec)
            progress.advance(f"{spec.name}: ok")

    progress = Progress(total=4, what="jobs")      # or without `with`: the bar ends with the last
    progress.advance("kvps job done")             # item, or at exit if the loop raises first

Plain lines look like `[3/20] digits sync W=3: ok (41s, about 3m58s left)`. The ETA is the mean
time per item so far times the items left. Output goes to stderr, as the tools' tables go to stdout.
"""
import atexit
import sys
import time


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    def __init__(self, total, what="steps", stream=None, bar=None, clock=time.monotonic):
        """`bar`: force the rich bar (True) or plain lines (False); default: a bar on a terminal."""
        self.total, self.what = int(total), what
        self.stream = stream or sys.stderr
        self.done = 0
        self._clock = clock
        self._start = clock()
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self._bar = isatty if bar is None else bar
        self._rich = self._task = None

    def __enter__(self):
        self._start_bar()
        return self

    def _start_bar(self):
        if not self._bar or self._rich is not None:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeElapsedColumn
        except ImportError:
            self._bar = False
            return
        # While the bar shows, rich prints what the command writes to stdout above it, on our stream:
        # only when stdout is a terminal too, or `kvps experiment > log` would lose its lines from the log.
        tty_out = getattr(sys.stdout, "isatty", lambda: False)()
        self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                                  console=Console(file=self.stream), transient=False, redirect_stdout=tty_out)
        self._rich.start()
        self._task = self._rich.add_task(self.what, total=self.total, eta="-")
        # used without `with` (a loop that may raise): the bar still ends at exit
        atexit.register(self.close)

    def eta(self):
        """Seconds left by the mean time per item so far (None before the first item)."""
        if not self.done:
            return None
        return (self._clock() - self._start) / self.done * max(0, self.total - self.done)

    def advance(self, label=""):
        """One item done; the bar (started here if not yet) ends with the last item."""
        self.done += 1
        self._start_bar()
        if self._rich is not None:
            eta = self.eta()        # ours (the mean per item): rich's needs a steady rate of items
            self._rich.update(self._task, advance=1, description=f"{self.what}: {label}" if label else self.what,
                              eta=_duration(eta) if eta is not None else "-")
            if self.done >= self.total:
                self.close()
            return
        eta = self.eta()
        left = f", about {_duration(eta)} left" if eta and self.done < self.total else ""
        elapsed = _duration(self._clock() - self._start)
        self.stream.write(f"[{self.done}/{self.total}] {label or self.what} ({elapsed}{left})\n")
        self.stream.flush()

    def close(self):
        """Stop the bar (safe twice; plain lines need nothing)."""
        if self._rich is not None:
            rich, self._rich = self._rich, None
            rich.stop()
            atexit.unregister(self.close)

    def __exit__(self, *exc):
        self.close()
