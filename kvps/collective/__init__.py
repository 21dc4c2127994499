"""Collectives among the workers, with no servers: the ring all-reduce (ring.py)."""
