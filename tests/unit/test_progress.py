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
