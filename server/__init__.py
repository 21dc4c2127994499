"""The kvps key-value server: holds a shard of the parameters and applies pushes.

    kvps server --scheduler HOST:PORT [--plugin MODULE]
    python -m server ...                                    # the same

Modules: server (the daemon: messages in, replies out), __main__ (its command line).
The state it keeps, with no sockets, is kvps.ps: store, clocks, rules.
"""
