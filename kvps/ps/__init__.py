"""The parameter server's state machine, with no sockets: store (values, sync rounds), clocks
(consistency bookkeeping), rules (server-side update rules), sharding, consistency and compression."""
