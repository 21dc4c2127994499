"""The kvps scheduler: registers servers and workers, assigns ranks, runs barriers,
watches heartbeats and ends the job when the workers finish.

    kvps scheduler --port 0 --num-workers 2 --num-servers 1     # prints "READY HOST:PORT"
    python -m scheduler ...                                  # the same
"""
from scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
