"""A calibrated model of fault recovery at scales this project cannot run.

Forward recovery (ULFM shrink, in-step repair, the workload policy's redistribution) against
checkpoint-restart every ``N`` steps, for a config on a hardware profile:

- :mod:`.constants`: every number of the model in one table per profile (``a100-512``,
  ``this-machine``), each with its source;
- :mod:`.workload`: a step's cost from the config (FLOPs, TP/PP/DP traffic, bytes to save and move);
- :mod:`.events`: the discrete-event model of a run in each mode under a fault schedule;
- :mod:`.report`: ``nanotron-recover simulate``, its table and plot;
- :mod:`.validation`: the this-machine prediction of ``benchmarks/faults.py --quick``.

The model is checked against this machine (``benchmarks/simulate_validation.py``): with the
``this-machine`` constants it predicts ``benchmarks/faults.py --quick`` within 8% (wall time), 9%
(effective throughput) and 16% (stall per fault); the paper-like ``faults.py`` run it misses by its
micro-batch (wall time +21% to +38%, forward stall 0.31 s against 0.03 s), and its forward-recovery
reduction term is checked against ``benchmarks/reduction.py`` (``validation.TOLERANCES`` holds the
bound of each quantity). At 512 GPUs it is a model: constants that could not be measured here are
labelled assumed or extrapolated in the table.

Submodules are imported where used (``from nanotron_recover.simulate.events import simulate``): the
CLI builds its parser from :mod:`.options` without importing torch.
"""
