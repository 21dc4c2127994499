"""`kvps experiment`: real models trained on real data under each consistency mode (sync, async,
SSP, backup workers, GEO-SGD, ring all-reduce; with gradient compression too), with and without a
straggler, and a report of the results.

    kvps experiment --quick              # or python -m kvps.tools.experiment --quick
    kvps experiment --tiny --out /tmp/x  # the end-to-end check the tests run
    kvps experiment --quick --emulate 100mbit --repeats 5

Modules, one concept each:

    logbook   what a worker measures and prints (the JSON lines); used by the workloads
    presets   workloads, modes, presets (their repeats); plan() lists the cells, emulated() adds
              their twins on `kvps emulate` hosts
    runner    run(): one job under `kvps launch`, with a deadline; its JSON lines read back
    metrics   time to target, throughput, staleness: pure functions of results.json, and their format;
              cell(): a cell's medians over its repeats
    intervals medians with 95% bootstrap intervals, and when two overlap ("no clear difference")
    findings  plain-words findings generated from those numbers
    report    report.md, results.json and the PNG plots
    cli       main(argv): the command

docs/experiment.md says what runs and how to read the report.
"""


def main(argv=None):
    from kvps.tools.experiment.cli import main as run
    return run(argv)
