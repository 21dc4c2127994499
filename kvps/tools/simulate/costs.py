"""The measured costs `kvps simulate` predicts from, and the file `kvps simulate calibrate` writes.

    costs = Costs.load("reports/simulate/costs.json")     # or Costs() for the defaults below
    costs.transport("veth")                               # Transport(per_message_s, per_byte_s)

Fields (all seconds, bytes or bit/s):

* transports: for each way bytes travel between processes, the CPU a message costs at each
  end, per_message_s + per_byte_s * bytes: "loopback" (127.0.0.1, what a job on one machine
  uses) and "veth" (between `kvps emulate` hosts: veth pairs, a bridge and tbf qdiscs). A round
  of one message each way pays it four times (worker send, server receive, server send, worker
  receive); calibrate fits both numbers to such rounds.
* sum_bytes_per_s: the summation kernel (a server adding a push into its buffer; the ring's
  reduce step), bytes of one operand per second.
* copy_bytes_per_s: a memory copy (np.copyto), bytes per second: the ring kvstore copies every
  gradient into its fusion buffers and every result out of them.
* link_efficiency: payload bytes per configured link byte (TCP/IP headers in 1500-byte frames:
  about 0.954), measured over an emulated link.
* fan_in_efficiency: {"k": payload bytes per configured link byte when k hosts send into one
  link at once} (TCP flows sharing one tbf queue lose some of it to drops and backoff), measured
  for a few k; the model uses the largest measured k not above a link's senders (a server's
  downlink has W, a worker's S), and link_efficiency where none is.
* latency_s: one-way delay between two hosts (0 on the emulated links here: no netem).
* per_call_s: the worker's cost of a kvstore call (push, pull or pushpull) beyond its
  messages, for each key the call names: checking the arguments, building the messages, handing
  them to the I/O thread, waiting and filling the outputs, in Python (a push of one key pays it
  once, a pushpull of ResNet-50's 161 keys 161 times). It is paid on the calling thread, one call
  after another. calibrate measures it from loops of calls of tiny keys.
* per_call_crowded_s: what a call costs more for each busy process (worker or server) beyond
  host_cores, where a job's processes share them: an assumption that the cost grows linearly
  with the crowding, from calibrate's two points (1 worker and 1 server; 4 and 4). Each wake-up
  of a worker's calling thread or I/O thread then waits for a core.
* host_cores: the CPUs a whole job shares when all its processes run on one machine (the
  validation runs), or None for a cluster where every process has CPUs of its own.

The defaults are round figures of the same order as this project's 2-core machine measured;
predictions quote the file they used.
"""
import dataclasses
import json

from kvps.errors import ConfigError

Transport = dataclasses.make_dataclass("Transport", [("per_message_s", float), ("per_byte_s", float)], frozen=True)


@dataclasses.dataclass(frozen=True)
class Costs:
    transports: dict = dataclasses.field(default_factory=lambda: {
        "loopback": {"per_message_s": 60e-6, "per_byte_s": 0.25e-9},
        "veth": {"per_message_s": 80e-6, "per_byte_s": 1.0e-9},
        "cluster": {"per_message_s": 30e-6, "per_byte_s": 0.1e-9}})
    sum_bytes_per_s: float = 4e9
    copy_bytes_per_s: float = 8e9
    link_efficiency: float = 0.954
    fan_in_efficiency: dict = dataclasses.field(default_factory=dict)
    latency_s: float = 0.0
    per_call_s: float = 100e-6
    per_call_crowded_s: float = 0.0
    host_cores: int = None
    source: str = "defaults (kvps/tools/simulate/costs.py)"
    measured: dict = dataclasses.field(default_factory=dict)     # the raw measurements calibrate fitted

    def transport(self, name):
        """The Transport `name`; raises ConfigError naming the ones the file has."""
        if name not in self.transports:
            raise ConfigError(f"transport {name!r} is not in the costs ({', '.join(sorted(self.transports))})")
        t = self.transports[name]
        return Transport(float(t["per_message_s"]), float(t["per_byte_s"]))

    def efficiency(self, senders):
        """Payload per link byte with `senders` hosts sending into one link (fan_in_efficiency)."""
        known = [int(k) for k in self.fan_in_efficiency if int(k) <= senders]
        return float(self.fan_in_efficiency[str(max(known))]) if known else self.link_efficiency

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def save(self, path):
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path):
        """Costs from a calibrate file; raises ConfigError naming the file and what is wrong with it."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"costs file {path!r} cannot be read: {exc}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if not isinstance(data, dict) or unknown:
            raise ConfigError(f"costs file {path!r} has fields this kvps does not know: {unknown}")
        return cls(**data)


def zero():
    """Costs with no overhead at all: the bandwidth bound's assumptions (the tests' limit)."""
    free = {"per_message_s": 0.0, "per_byte_s": 0.0}
    return Costs(transports={"loopback": free, "veth": free, "cluster": free}, sum_bytes_per_s=float("inf"),
                 copy_bytes_per_s=float("inf"),
                 link_efficiency=1.0, latency_s=0.0, per_call_s=0.0, source="zero overhead")
