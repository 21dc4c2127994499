"""The bandwidth bound on one synchronous step: seconds to sync M bytes of gradients over host
links of B bit/s each, full duplex, through a switch that is never the bottleneck.

    theory(102_228_128, 1e9, W=4, S=1)                  # Prediction(ring=1.227, ps=3.271)
    theory(102_228_128, 1e9, W=4, S=4, colocated=True)  # ps == ring: BytePS's observation

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

With S = W co-located servers the PS bound is 2(W-1)/W * T, the ring's. docs/emulate.md has the
derivations and the figures measured beside them. The bound assumes keys spread evenly over the
servers and ignores protocol headers (TCP/IP over 1500-byte frames carries ~95% payload).
"""
import collections

from kvps.errors import ConfigError

Prediction = collections.namedtuple("Prediction", "ring ps")
Prediction.__doc__ = "Seconds per step at the bandwidth bound: ring all-reduce and parameter server."


def theory(M_bytes, B_bits_per_s, W, S, colocated=False):
    """Predicted seconds per step (see the module docstring). Raises ConfigError for values that
    describe no job: W or S below 1, B not positive, M negative, or more co-located servers than hosts."""
    if W < 1 or S < 1:
        raise ConfigError(f"W={W}, S={S}: a job needs at least one worker and one server")
    if B_bits_per_s <= 0:
        raise ConfigError(f"B={B_bits_per_s!r} bit/s must be positive")
    if M_bytes < 0:
        raise ConfigError(f"M={M_bytes!r} bytes must not be negative")
    if colocated and S > W:
        raise ConfigError(f"S={S} co-located servers need at least as many worker hosts (W={W})")
    T = 8.0 * M_bytes / B_bits_per_s
    ring = 2.0 * (W - 1) / W * T
    if colocated:
        ps = max((S + W - 2) / S, 1.0 if S < W else 0.0) * T
    else:
        ps = max(1.0, W / S) * T
    return Prediction(ring, ps)
