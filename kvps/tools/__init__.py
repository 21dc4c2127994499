"""Tools built on the library, which the library never imports: bench (benchmarks against numpy,
torch gloo and MXNet), emulate (clusters of emulated hosts) and experiment (training runs and reports)."""
