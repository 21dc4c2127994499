"""What the benchmarks' baseline jobs (gloo_job.py, mxnet_job.py) share: child processes started
in sessions of their own, their output in one log file each, waited for with a deadline and
stopped by pid (SIGTERM, then SIGKILL) -- never a process the job did not start."""
import os
import subprocess

from kvps.launcher import stop_processes, wait_children

TIMED_OUT = 124            # wait()'s result when the deadline passes (as timeout(1))
STOP_TIMEOUT = 5.0         # seconds between SIGTERM and SIGKILL
POLL = 0.05                # seconds between checks of the children


class LoggedJob:
    """Children named H, S<j>, W<i>; the job is done when every W has exited."""

    prefix = "job"         # log files are PREFIX-<name>.log in logdir
    label = "job"          # names the children in logs()
    drain = 0.0            # seconds the other children get to exit once the workers have

    def __init__(self, logdir):
        self.logdir = logdir
        self.procs = []            # (name, Popen)

    def _spawn(self, name, argv, env):
        with open(self._log(name), "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))

    def _log(self, name):
        return os.path.join(self.logdir, f"{self.prefix}-{name}.log")

    def wait(self, timeout):
        """Wait until every worker has exited, then up to `drain` for the others. Returns 0 when all
        exited cleanly, the first failure's exit code (a signal as 128+signal), or TIMED_OUT. Every
        child is stopped on return."""
        try:
            code = wait_children(self.procs, timeout, self.drain, poll=POLL)
            return TIMED_OUT if code is None else code
        finally:
            self.stop()

    def stop(self):
        """SIGTERM every child still running, then SIGKILL those still there after STOP_TIMEOUT."""
        stop_processes([p for _, p in self.procs], STOP_TIMEOUT)

    def output(self, name):
        with open(self._log(name), errors="replace") as f:
            return f.read()

    def logs(self, tail=3000):
        """Each child's exit status and the end of its log, for error messages."""
        parts = []
        for name, proc in self.procs:
            status = "running" if proc.poll() is None else f"exit {proc.returncode}"
            parts.append(f"--- {self.label} {name} ({status})\n{self.output(name)[-tail:].rstrip()}")
        return "\n".join(parts)
