"""Qualification: the evidence that the donor and copies restored after it is gone serve exactly
like an ordinary start, and that every broken or stale activation fails closed.

``workload`` sends the fixed set of requests and records what came back; ``checks`` turns
observations into pass/fail results with evidence (pure functions, no I/O); ``watch`` observes
the system around a run (listeners, leftovers, an activation's exit); ``reference`` is the
ordinary start without capture; ``runs`` performs the serving runs (donor, copies),
``faults`` the fail-closed ones (fault, stale), ``lazy_fault`` the lazy-pages daemon's death
mid-transfer and ``criu_faults`` the CRIU-level faults;
``suite`` runs them in order; ``report`` is the report model, its writers and its table.
See docs/qualification.md.
"""
