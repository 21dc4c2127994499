"""What the tools read off the jobs they start: their output, and their processes' memory.

    out = Lines()                       # the `out` stream of kvps.launch.Job or EmulatedJob
    out.text()                          # everything the job printed
    rss_mb(pid)                         # a process's resident memory in MB, None once it is gone
"""


class Lines:
    """An output stream that keeps everything written to it, and echoes it to `echo` if given."""

    def __init__(self, echo=None):
        self._parts = []
        self._echo = echo

    def write(self, text):
        self._parts.append(text)
        if self._echo is not None:
            self._echo.write(text)

    def flush(self):
        if self._echo is not None:
            self._echo.flush()

    def text(self):
        return "".join(self._parts)


def rss_mb(pid):
    """Resident memory of a process in MB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
