"""Bounds on what a peer can make a node write to its log: how often (LogThrottle) and what (escape).

    throttle = LogThrottle(lines=20, interval=10.0)
    throttle(log, logging.WARNING, "%s: dropped a bad message from %s: %s", name, escape(who), why)

At most `lines` lines go out per `interval` seconds; the rest are counted, and the first line let
through after them says how many were suppressed (nothing is lost silently, and 20,000 bad
messages write a few lines, not 63 MB). Text quoted from the network goes through `escape` (or
kvps.wire.protocol.quote, which also quotes it), so a newline in a peer's name cannot forge a log
line. A throttle is used on one thread (the I/O thread that owns it), so it takes no lock.
"""
import time


def escape(text, limit=400):
    """`text` cut to `limit` characters, with every character that is not printable (newlines,
    escape sequences, line separators) written as its Python escape."""
    text = str(text)
    cut = len(text) > limit
    text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text + ("..." if cut else "")


class LogThrottle:
    def __init__(self, lines=20, interval=10.0, clock=time.monotonic):
        self.lines, self.interval, self._clock = lines, interval, clock
        self._window = None         # start of the current interval
        self._used = 0              # lines written in it
        self.suppressed = 0         # lines dropped since the last one written

    def __call__(self, logger, level, fmt, *args, exc_info=None):
        """Log fmt % args at `level` unless this interval's lines are used up; returns whether it did."""
        if not logger.isEnabledFor(level):
            return False
        now = self._clock()
        if self._window is None or now - self._window >= self.interval:
            self._window, self._used = now, 0
        if self._used >= self.lines:
            self.suppressed += 1
            return False
        self._used += 1
        if self.suppressed:
            fmt = f"{fmt} (and {self.suppressed} similar lines suppressed: at most {self.lines} per {self.interval:g} s)"
            self.suppressed = 0
        logger.log(level, fmt, *args, exc_info=exc_info)
        return True
