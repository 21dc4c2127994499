"""What `kvps experiment` runs: the workloads, the consistency modes, and the presets (grids).

    plan(PRESETS["quick"])          # [RunSpec], in the order they run
    kvstore_type("ssp:4")           # "dist_ssp:4"

A preset is a grid: workloads x worker counts x (no straggler, a 2x straggler) x modes. Within
one workload and worker count the runs without a straggler come first, sync first of all,
because the straggler's delay is set from the sync run's measured step time.
"""
import dataclasses
import re

MODE_HELP = "sync, async, ssp:S (S an int >= 0, or inf), backup:B, allreduce"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training script in kvps.tools.experiment.workloads and its arguments at each size."""
    name: str
    module: str                  # run as python -m MODULE
    title: str                   # one line for the report
    target: float                # default test-accuracy target for time-to-target
    sizes: dict                  # size ("tiny", "quick", "full") -> tuple of script arguments
    step_timeout: float          # seconds allowed per 1000 steps, on top of start-up (for the deadline)


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
        step_timeout=60.0),
}

QUICK_MODES = ("sync", "async", "ssp:1", "ssp:4", "backup:1", "allreduce")
FULL_MODES = ("sync", "async", "ssp:1", "ssp:2", "ssp:4", "ssp:8", "backup:1", "allreduce")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    size: str                     # which of each workload's argument sets
    workloads: tuple
    modes: tuple
    workers: tuple
    stragglers: tuple = (False, True)
    straggler_modes: tuple = None   # the modes run with the straggler (None: every mode)
    workload_modes: dict = None     # workload -> its own modes, where it runs fewer than `modes`
    servers: int = 1
    timeout: float = 180.0        # default deadline of one run, seconds


PRESETS = {
    "tiny": Preset("tiny", "tiny", ("digits",), QUICK_MODES, (2,), straggler_modes=("sync", "async"), timeout=60.0),
    "quick": Preset("quick", "quick", ("digits", "sparse"), QUICK_MODES, (3,),
                    workload_modes={"sparse": ("sync", "async", "ssp:4", "allreduce")}, timeout=120.0),
    "full": Preset("full", "full", ("digits", "sparse"), FULL_MODES, (2, 4), timeout=300.0),
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

    @property
    def id(self):
        return f"{self.workload}/W{self.workers}/{self.mode}/{'straggler' if self.straggler else 'none'}"

    @property
    def kvstore(self):
        return kvstore_type(self.mode)


def kvstore_type(mode):
    """The kvps.create() type of a mode name; raises ValueError naming a bad one."""
    if mode in ("sync", "async"):
        return f"dist_{mode}"
    if mode == "allreduce":
        return "allreduce"
    m = re.fullmatch(r"ssp:(\d+|inf)", mode)
    if m:
        return f"dist_ssp:{m.group(1)}"
    m = re.fullmatch(r"backup:(\d+)", mode)
    if m:
        return f"dist_sync:backup={m.group(1)}"
    raise ValueError(f"mode {mode!r} is not one of {MODE_HELP}")


def servers_for(mode, servers):
    """The ring needs no servers; every other mode uses `servers`."""
    return 0 if mode == "allreduce" else servers


def check_modes(modes, workers):
    """Raise ValueError for a mode that cannot run with some worker count (backup:B needs B < W)."""
    for mode in modes:
        kvstore_type(mode)
        m = re.fullmatch(r"backup:(\d+)", mode)
        if m:
            small = [w for w in workers if int(m.group(1)) >= w]
            if small:
                raise ValueError(f"mode {mode!r} needs more than {m.group(1)} workers; --workers has {small[0]}")


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
        ordered = sorted(own, key=lambda m: m != "sync")      # sync first: it measures the step time
        for w in workers:
            if calibrate and True in stragglers and (False not in stragglers or "sync" not in own):
                specs.append(RunSpec(workload, "sync", w, servers_for("sync", servers), False, args))
            for straggler in sorted(stragglers):              # False first
                for mode in ordered:
                    if straggler and preset.straggler_modes is not None and not explicit \
                            and mode not in preset.straggler_modes:
                        continue
                    specs.append(RunSpec(workload, mode, w, servers_for(mode, servers), straggler, args))
    return specs


def steps_of(args):
    """The --steps value in a script's arguments."""
    return int(args[list(args).index("--steps") + 1]) if "--steps" in args else 1000
