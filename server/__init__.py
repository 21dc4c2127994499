"""The kvps key-value server: holds a shard of the parameters and applies pushes.

    kvps server --scheduler HOST:PORT [--plugin MODULE]
    python -m kvps.server ...                                    # the same

Modules: store (values, sync rounds, async and ssp updates), clocks (what each
worker has pushed and seen: the consistency rules), updaters (server-side
optimizer rules and their registry), server (the daemon: messages in, replies out).
"""
