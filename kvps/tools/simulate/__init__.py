"""`kvps simulate`: a discrete-event model of one synchronous training step, for a parameter
server (W workers, S servers, partitions, pipelining, priority, compression) and for a ring
all-reduce (fusion, chunks), calibrated with costs measured on this machine.

    kvps simulate calibrate                      # measure the costs: reports/simulate/costs.json
    kvps simulate validate                       # predicted vs measured on `kvps emulate` hosts
    kvps simulate sweep --workers 2..1024 --rate 10gbit,25gbit,100gbit --model resnet50,bert-large
    kvps simulate predict --system ring -n 64 --rate 25gbit --model bert-large

Modules, one concept each:

    engine     the event loop and queued resources
    costs      Costs: the measured inputs, and their file
    models     the gradient sets (ResNet-50, BERT-large, the experiment's MLP) and compute times
    step       Setup and predict(): the PS and ring models
    calibrate  measuring the costs here
    validate   predictions beside `kvps emulate sync` measurements
    sweep      the 2..1,024-worker sweep, its table and plot
    cli        main(argv)

docs/simulate.md explains the model, how to read its output and where its assumptions stop holding.
"""


def main(argv=None):
    from kvps.tools.simulate.cli import main as run
    return run(argv)
