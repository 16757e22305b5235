"""Fault campaigns ("chaos"): send every fault the project survives to a real job, from outside,
at moments the job does not choose, and judge the result against the fault-free run.

- :mod:`.kinds`: the fault vocabulary (one-host kinds and the node-level ones a cluster would send);
- :mod:`.schedule`: a seeded, pure draw of which fault, when and on whom; JSON for ``--replay``;
- :mod:`.targets`: the job's rank processes and how to signal them (one host: :class:`LocalTarget`);
- :mod:`.watch`: following the run directory's records (commits, incidents, relaunches);
- :mod:`.runner`: starting the job as ``launch`` does, sending the faults, catching a hang;
- :mod:`.reference`: the plain fault-free run of the same config, run once and reused;
- :mod:`.report`: per-fault reactions and totals, ``chaos.json`` and ``chaos.md``, the verdict;
- :mod:`.command`: ``nanotron-recover chaos``.
"""
