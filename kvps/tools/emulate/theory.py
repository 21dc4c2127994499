"""The bandwidth bound on one synchronous step: seconds to sync M bytes of gradients over host
links of B bit/s each, full duplex, through a switch that is never the bottleneck.

    theory(102_228_128, 1e9, W=4, S=1)                  # Prediction(ring=1.227, ps=3.271)
    theory(102_228_128, 1e9, W=4, S=4, colocated=True)  # ps == ring: BytePS's observation
    theory(102_228_128, 1e9, W=2, S=2, replicas=1)      # Prediction(ring=0.818, ps=1.227): rounds' sums

Every host link carries data both ways at once, so a step takes as long as the busiest direction
of the busiest link. With T = 8*M/B (one model's worth through one link):

  ring all-reduce      each of W hosts sends, and receives, 2(W-1)/W * M   -> 2(W-1)/W * T
  PS, dedicated        a worker sends M (push) and receives M (pull); a server host receives
  (S server hosts)     W*M/S and sends W*M/S                               -> max(1, W/S) * T
  PS, co-located       server j shares host j with worker j (S <= W). On such a host the worker
  (S of the W hosts)   pushes (S-1)/S*M to the other servers (its own share stays in the host)
                       and the server receives (W-1)/S*M from the other workers; the pulls carry
                       the same amounts the other way. A worker alone on its host sends and
                       receives M                               -> max((S+W-2)/S, [S<W]) * T

With S = W co-located servers the PS bound is 2(W-1)/W * T, the ring's.

Chain replication (KVPS_REPLICAS=R, server/replication.py) adds server-to-server bytes: the ranges
of home h live on servers h, h+1, ..., h+R. With R = 1 (these steps are sync) the head sends each
round's sum to its replica, M/S a step, and the copies of the pushes carry no values; with R >= 2
each member but the tail forwards every push it applies (each worker's, W of them a step). So a
server sends C*M/S more, C = 1 for R = 1 and R*W for R >= 2 (it is the head of one chain and a
middle member of R-1), and receives as much from its predecessors; the pulls are answered by the
head alone, as without replicas. Every server-to-server hop crosses a host link (one server per
host, in both placements), so:

  PS, dedicated, R     a server host carries (W+C)*M/S each way            -> max(1, (W+C)/S) * T
  PS, co-located, R    a host with a server carries (S+W-2+C)/S*M each way
                                                                -> max((S+W-2+C)/S, [S<W]) * T

docs/emulate.md has the derivations and the figures measured beside them. The bound assumes keys
spread evenly over the servers and ignores protocol headers (TCP/IP over 1500-byte frames carries
~95% payload) and the small replies along a chain.
"""
import collections

from kvps.errors import ConfigError

Prediction = collections.namedtuple("Prediction", "ring ps")
Prediction.__doc__ = "Seconds per step at the bandwidth bound: ring all-reduce and parameter server."


def theory(M_bytes, B_bits_per_s, W, S, colocated=False, replicas=0):
    """Predicted seconds per step (see the module docstring); `replicas`: chain replication's R,
    which only the PS bound counts. Raises ConfigError for values that describe no job: W or S
    below 1, B not positive, M negative, more co-located servers than hosts, or R negative or not
    below S (a chain needs R+1 servers)."""
    if W < 1 or S < 1:
        raise ConfigError(f"W={W}, S={S}: a job needs at least one worker and one server")
    if B_bits_per_s <= 0:
        raise ConfigError(f"B={B_bits_per_s!r} bit/s must be positive")
    if M_bytes < 0:
        raise ConfigError(f"M={M_bytes!r} bytes must not be negative")
    if colocated and S > W:
        raise ConfigError(f"S={S} co-located servers need at least as many worker hosts (W={W})")
    if replicas < 0 or (replicas and replicas >= S):
        raise ConfigError(f"R={replicas} replicas need {replicas + 1} or more servers (S={S})"
                          if replicas > 0 else f"R={replicas} replicas must not be negative")
    T = 8.0 * M_bytes / B_bits_per_s
    ring = 2.0 * (W - 1) / W * T
    chain = chain_copies(W, replicas)
    if colocated:
        ps = max((S + W - 2 + chain) / S, 1.0 if S < W else 0.0) * T
    else:
        ps = max(1.0, (W + chain) / S) * T
    return Prediction(ring, ps)


def chain_copies(W, replicas):
    """What a server of a sync job sends along its chains a step, in units of M/S (its share of the
    model): one round sum with one replica, every worker's push for each of R >= 2 (0 without)."""
    return 0 if replicas == 0 else 1 if replicas == 1 else replicas * W
