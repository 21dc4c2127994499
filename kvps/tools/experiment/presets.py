"""What `kvps experiment` runs: the workloads, the consistency modes, and the presets (grids).

    plan(PRESETS["quick"])          # [RunSpec], in the order they run
    kvstore_type("ssp:4")           # "dist_ssp:4"
    parse_mode("geo:4+fp16+pull")   # Mode: kvstore "dist_geo:4", compression {"type": "fp16", "pull": True}

A preset is a grid: workloads x worker counts x (no straggler, a 2x straggler) x modes x
networks (this machine's loopback, and with --emulate each emulated link rate), each cell run
`repeats` times with seeds seed, seed+1, ... Within one workload and worker count the runs
without a straggler come first, sync first of all, because the straggler's delay is set from the
sync run's measured step time. Emulated cells run without the straggler (`kvps emulate` gives
every worker the same environment).

A mode is a consistency mode, optionally followed by a gradient compression: `sync`, `geo:4`,
`sync+2bit` (pushes compressed), `sync+fp16+pull` (pushes and pulls). The compression reaches the
script as `--compression JSON` (kv.set_gradient_compression; docs/compression.md).
"""
import dataclasses
import json
import re

MODE_HELP = ("sync, async, ssp:S (S an int >= 0, or inf), backup:B, geo:K (GEO-SGD, a sync every K local "
             "steps), allreduce; a parameter-server mode may add +CODEC (compressed pushes: 2bit[:T], 1bit[:T], "
             "fp16, bf16, topk[:R]) and then +pull (compressed pulls too): sync+2bit, sync+fp16+pull")
FAMILIES = ("sync", "async", "ssp", "backup", "geo", "allreduce")
CODECS = {"2bit": "threshold", "1bit": "threshold", "fp16": None, "bf16": None, "topk": "ratio"}   # -> its :VALUE


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training script in kvps.tools.experiment.workloads and its arguments at each size."""
    name: str
    module: str                  # run as python -m MODULE
    title: str                   # one line for the report
    target: float                # default test-accuracy target for time-to-target
    sizes: dict                  # size ("tiny", "quick", "full") -> tuple of script arguments
    step_timeout: float          # seconds allowed per 1000 steps, on top of start-up (for the deadline)
    families: tuple = FAMILIES   # the mode families its script can run
    compression: bool = True     # whether its script takes --compression


WORKLOADS = {
    "digits": Workload(
        "digits", "kvps.tools.experiment.workloads.digits",
        "MLP (64-64-10) on scikit-learn's handwritten digits (1,347 train / 450 test images), SGD lr 0.1, "
        "batch 32 per worker", 0.95,
        {"tiny": ("--steps", "60", "--eval-every", "20"),
         "quick": ("--steps", "600", "--eval-every", "0.1s"),
         "full": ("--steps", "2500", "--eval-every", "0.1s")},
        step_timeout=20.0),
    "sparse": Workload(
        "sparse", "kvps.tools.experiment.workloads.sparse_lr",
        "sparse logistic regression, synthetic ad-click style (Zipf features, 20-50 active of D), "
        "SGD lr 2, batch 256 per worker", 0.67,
        {"tiny": ("--dim", "4096", "--keys", "8", "--train", "4000", "--test", "2000", "--steps", "40",
                  "--eval-every", "10", "--lr", "2"),
         "quick": ("--dim", "65536", "--keys", "32", "--train", "60000", "--test", "10000", "--steps", "400",
                   "--eval-every", "0.2s", "--lr", "2"),
         "full": ("--dim", "1048576", "--keys", "64", "--train", "200000", "--test", "10000", "--steps", "1000",
                  "--eval-every", "0.5s", "--lr", "2")},
        # row-sparse pushes and pulls: no GEO path (it moves whole weights), and pulls that are
        # never compressed (docs/compression.md), so no --compression either
        step_timeout=60.0, families=("sync", "async", "ssp", "backup", "allreduce"), compression=False),
    "wide": Workload(
        "wide", "kvps.tools.experiment.workloads.digits",
        "MLP (64-128-128-10, 26,122 parameters: 104 KB of gradients per step) on the digits, SGD lr 0.2, "
        "batch 512 per worker: about as long to compute as to send over 100 Mbit/s", 0.95,
        {"tiny": ("--model", "wide", "--batch", "512", "--lr", "0.2", "--steps", "30", "--eval-every", "10"),
         "quick": ("--model", "wide", "--batch", "512", "--lr", "0.2", "--steps", "200", "--eval-every", "0.2s"),
         "full": ("--model", "wide", "--batch", "512", "--lr", "0.2", "--steps", "400", "--eval-every", "0.2s")},
        step_timeout=120.0),
}
EMULATED_WORKLOADS = ("wide",)      # what --emulate runs unless --workloads says otherwise

QUICK_MODES = ("sync", "async", "ssp:1", "ssp:4", "backup:1", "allreduce")
FULL_MODES = ("sync", "async", "ssp:1", "ssp:2", "ssp:4", "ssp:8", "backup:1", "allreduce")
GEO_MODES = ("geo:1", "geo:4", "geo:16")
# Compressed pull beside plain sync and push-only compression. Under sync with a server optimizer
# the pulls bring weights, which the servers compress as changes against the worker's copy:
# fp16 suits that; 2bit moves a weight by whole thresholds (docs/compression.md), which the
# cell shows.
COMPRESSION_MODES = ("sync+fp16", "sync+fp16+pull", "sync+2bit", "sync+2bit+pull")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    size: str                     # which of each workload's argument sets
    workloads: tuple
    modes: tuple
    workers: tuple
    stragglers: tuple = (False, True)
    straggler_modes: tuple = None   # the modes run with the straggler (None: every mode)
    clean_modes: tuple = None       # the modes run without it (None: every mode)
    workload_modes: dict = None     # workload -> its own modes, where it runs fewer than `modes`
    servers: int = 1
    timeout: float = 180.0        # default deadline of one run, seconds
    repeats: int = 1              # runs of each cell, with seeds seed, seed+1, ...
    emulated_modes: tuple = ("sync", "async", "allreduce")   # the modes run on emulated hosts


# quick repeats a reduced grid: 3 x the old 20 runs (each about 9 s of start-up and training on an
# idle 2-core machine, 15 s on a loaded one) would take 9 to 15 minutes; 3 x these 7 cells take
# 3.5 to 5 (docs/experiment.md).
PRESETS = {
    "tiny": Preset("tiny", "tiny", ("digits",), QUICK_MODES, (2,), straggler_modes=("sync", "async"), timeout=60.0),
    "quick": Preset("quick", "quick", ("digits",), ("sync", "async", "ssp:4", "allreduce", "backup:1"), (3,),
                    straggler_modes=("sync", "async", "backup:1"), timeout=120.0, repeats=3,
                    clean_modes=("sync", "async", "ssp:4", "allreduce")),
    # the digits also run GEO-SGD (with and without the straggler) and compression (without it);
    # the sparse workload's script has neither (Workload.families)
    "full": Preset("full", "full", ("digits", "sparse"), FULL_MODES + GEO_MODES + COMPRESSION_MODES, (2, 4),
                   timeout=300.0, repeats=5, straggler_modes=FULL_MODES + GEO_MODES,
                   workload_modes={"sparse": FULL_MODES}),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One job: a workload under one mode, W workers, with or without the straggler."""
    workload: str
    mode: str
    workers: int
    servers: int
    straggler: bool
    args: tuple
    net: str = "local"            # "local" (loopback), or an emulated link rate such as "100mbit"

    @property
    def id(self):
        """The cell's id (a run's id adds /r<repeat> when there are repeats)."""
        text = f"{self.workload}/W{self.workers}/{self.mode}/{'straggler' if self.straggler else 'none'}"
        return text if self.net == "local" else f"{text}/{self.net}"

    @property
    def kvstore(self):
        return kvstore_type(self.mode)

    @property
    def mode_args(self):
        """The script arguments the mode adds (--compression JSON), before the workload's own."""
        return parse_mode(self.mode).script_args


@dataclasses.dataclass(frozen=True)
class Mode:
    """A parsed mode name: its family (sync, async, ssp, backup, geo, allreduce), the kvps.create()
    type, the parameter (S, B or K; None for sync, async, allreduce) and the compression spec
    (kv.set_gradient_compression's dict) or None."""
    name: str
    family: str
    kvstore: str
    param: object = None
    compression: dict = None

    @property
    def base(self):
        """The mode without its compression ("sync" for "sync+fp16+pull")."""
        return self.name.partition("+")[0]

    @property
    def script_args(self):
        if self.compression is None:
            return ()
        return ("--compression", json.dumps(self.compression, separators=(",", ":")))


def parse_mode(mode):
    """The Mode a name means; raises ValueError naming a bad one."""
    if not isinstance(mode, str):
        raise ValueError(f"mode {mode!r} is not one of {MODE_HELP}")
    base, *extras = mode.split("+")
    if base in ("sync", "async", "allreduce"):
        family, kvstore, param = base, (base if base == "allreduce" else f"dist_{base}"), None
    else:
        m = re.fullmatch(r"(ssp):(\d+|inf)|(backup):(\d+)|(geo):([1-9]\d*)", base)
        if m is None:
            raise ValueError(f"mode {mode!r} is not one of {MODE_HELP}")
        if m.group(1):
            family, param = "ssp", m.group(2) if m.group(2) == "inf" else int(m.group(2))
            kvstore = f"dist_ssp:{param}"
        elif m.group(3):
            family, param = "backup", int(m.group(4))
            kvstore = f"dist_sync:backup={param}"
        else:
            family, param = "geo", int(m.group(6))
            kvstore = f"dist_geo:{param}"
    compression = _compression(mode, family, extras) if extras else None
    return Mode(mode, family, kvstore, param, compression)


def _compression(mode, family, extras):
    """kv.set_gradient_compression's dict for the +CODEC[:VALUE][+pull] part of a mode name."""
    if family == "allreduce":
        raise ValueError(f"mode {mode!r}: the ring sends values as they are; compression applies to the "
                         f"parameter-server modes")
    codec, *rest = extras
    name, colon, value = codec.partition(":")
    if name not in CODECS or rest not in ([], ["pull"]) or (colon and CODECS[name] is None):
        raise ValueError(f"mode {mode!r} is not one of {MODE_HELP}")
    spec = {"type": name}
    if colon:
        try:
            spec[CODECS[name]] = float(value)
        except ValueError:
            raise ValueError(f"mode {mode!r}: {CODECS[name]} {value!r} is not a number") from None
    if rest:
        spec["pull"] = True
    from kvps.ps.compression import check      # the library's own rules (thresholds, ratios)
    try:
        check(spec)
    except ValueError as exc:
        raise ValueError(f"mode {mode!r}: {exc}") from None
    return spec


def kvstore_type(mode):
    """The kvps.create() type of a mode name; raises ValueError naming a bad one."""
    return parse_mode(mode).kvstore


def servers_for(mode, servers):
    """The ring needs no servers; every other mode uses `servers`."""
    return 0 if parse_mode(mode).family == "allreduce" else servers


def check_modes(modes, workers):
    """Raise ValueError for a mode that cannot run with some worker count (backup:B needs B < W)."""
    for mode in modes:
        parsed = parse_mode(mode)
        if parsed.family == "backup":
            small = [w for w in workers if parsed.param >= w]
            if small:
                raise ValueError(f"mode {mode!r} needs more than {parsed.param} workers; --workers has {small[0]}")


def unsupported(workload, mode):
    """Why the workload's script cannot run the mode, or None when it can."""
    w, parsed = WORKLOADS[workload], parse_mode(mode)
    if parsed.family not in w.families:
        return f"{workload} has no {parsed.family} path (its script runs {', '.join(w.families)})"
    if parsed.compression is not None and not w.compression:
        return f"{workload}'s script takes no --compression (its pushes and pulls are row-sparse)"
    return None


def skipped(workloads, modes):
    """[(workload, mode, why)] for each asked mode a workload cannot run (plan() leaves them out)."""
    return [(w, m, why) for w in workloads for m in dict.fromkeys(modes) if (why := unsupported(w, m))]


def script_args(workload, size, steps=None, seconds=None, seed=None):
    """The script's arguments at this size, with --steps/--seconds/--seed overridden when given."""
    args = list(WORKLOADS[workload].sizes[size])
    for flag, value in (("--steps", steps), ("--seconds", seconds), ("--seed", seed)):
        if value is None:
            continue
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    return tuple(args)


def plan(preset, workloads=None, modes=None, workers=None, stragglers=None, servers=None, steps=None,
         seconds=None, seed=None, calibrate=True):
    """The runs of a preset (with any of its lists overridden), in the order they must run. With
    `calibrate`, a group that runs the straggler gets a sync run without it, to measure the step."""
    workloads = tuple(workloads or preset.workloads)
    explicit = modes is not None          # modes given: each runs with the straggler too
    modes = tuple(modes or preset.modes)
    workers = tuple(workers or preset.workers)
    stragglers = tuple(preset.stragglers if stragglers is None else stragglers)
    servers = preset.servers if servers is None else servers
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"workload {unknown[0]!r} is not one of {', '.join(WORKLOADS)}")
    check_modes(modes, workers)
    specs = []
    for workload in workloads:
        args = script_args(workload, preset.size, steps, seconds, seed)
        own = modes if explicit else (preset.workload_modes or {}).get(workload, modes)
        own = [m for m in own if unsupported(workload, m) is None]
        if not own:
            continue
        ordered = sorted(own, key=lambda m: m != "sync")      # sync first: it measures the step time
        for w in workers:
            if calibrate and True in stragglers and (False not in stragglers or "sync" not in own):
                specs.append(RunSpec(workload, "sync", w, servers_for("sync", servers), False, args))
            for straggler in sorted(stragglers):              # False first
                for mode in ordered:
                    if straggler and preset.straggler_modes is not None and not explicit \
                            and mode not in preset.straggler_modes:
                        continue
                    if not straggler and preset.clean_modes is not None and not explicit \
                            and mode not in preset.clean_modes:
                        continue
                    specs.append(RunSpec(workload, mode, w, servers_for(mode, servers), straggler, args))
    return specs


def emulated(specs, rates):
    """specs, then their straggler-free cells once more on emulated hosts at each rate (after every
    local run: the report puts each beside its local twin)."""
    return list(specs) + [dataclasses.replace(s, net=rate) for rate in rates for s in specs if not s.straggler]


def with_seed(args, seed):
    """The script's arguments with --seed set to seed."""
    args = list(args)
    if "--seed" in args:
        args[args.index("--seed") + 1] = str(seed)
    else:
        args += ["--seed", str(seed)]
    return tuple(args)


def steps_of(args):
    """The --steps value in a script's arguments."""
    return int(args[list(args).index("--steps") + 1]) if "--steps" in args else 1000
