"""Load tests and benchmarks: the harness (`load.harness`) and the experiments that use it."""
