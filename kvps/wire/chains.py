"""Which servers hold a key range under chain replication (KVPS_REPLICAS): a pure module.

The keys a worker's layout gives home rank h (kvps/ps/sharding.py) are held by the chain of
servers h, h+1, ..., h+R (mod S): the head is the primary, which workers send to; each member
forwards what changes the state to the next one, and answers only once the rest of the chain has
applied it (server/replication.py). A dead server drops out of every chain it is in, so the next
live one heads the chains it headed. A range whose whole chain is dead is lost: the job ends.

A new server that takes a dead one's rank (`joined`, in the order they joined) goes to the tail of
each chain of that rank, behind the members that kept the state meanwhile: the old tail sends it the
state and then forwards to it, so the chain is whole again and its head does not change.

    chain(home=1, num_servers=3, replicas=1, dead={1})  -> [2]
    chain(1, 3, 1, joined=[1])                          -> [2, 1]
    head(1, 3, 1, {1})                                  -> 2
    successor(0, 0, 3, 1, set())                        -> 1
"""


def chain(home, num_servers, replicas, dead=frozenset(), joined=()):
    """The live servers that hold home rank `home`'s ranges, head first."""
    members = [r for r in ((home + i) % num_servers for i in range(replicas + 1)) if r not in dead]
    return [r for r in members if r not in joined] + [r for r in joined if r in members]


def head(home, num_servers, replicas, dead=frozenset(), joined=()):
    """The server that takes the workers' requests for home rank `home`; None when all are dead."""
    members = chain(home, num_servers, replicas, dead, joined)
    return members[0] if members else None


def successor(home, me, num_servers, replicas, dead=frozenset(), joined=()):
    """The server `me` forwards home rank `home`'s updates to, or None (it is the chain's tail)."""
    members = chain(home, num_servers, replicas, dead, joined)
    if me not in members:
        return None
    at = members.index(me)
    return members[at + 1] if at + 1 < len(members) else None


def lost(num_servers, replicas, dead):
    """The home ranks whose every holder is dead (the job cannot go on without them)."""
    return [h for h in range(num_servers) if not chain(h, num_servers, replicas, dead)]


def homes_of(me, num_servers, replicas):
    """The home ranks whose chains `me` is in (its own, then those it replicates)."""
    return [(me - i) % num_servers for i in range(replicas + 1)]
