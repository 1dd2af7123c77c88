"""Benchmarks of snapctl: how soon a restored copy serves, measured side by side against a cold
start of the same server and against bare CRIU, with snapctl's overhead split into phases.

``python -m bench`` (``--quick``, ``--json``, ``--write-docs``). ``run`` owns the measurement
plan, ``contenders`` the timed ways to get a serving fixture, ``bare`` the CRIU baselines,
``workload`` the fixture and its correct answer, ``machine`` what the host does without snapctl,
``tally`` figures and targets, ``results`` the JSON format, ``docs`` the generated
docs/benchmarks.md and plot. Benchmarks print figures; tests never assert timings.
"""
