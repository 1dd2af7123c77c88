"""Lazy restores: a copy that serves before its memory is all in place.

Everything CRIU's lazy pages need lives here: the per-copy image view that leaves only big runs
of memory lazy (``pagemap``, ``netdumps``), the ``criu lazy-pages`` daemon started with its
restore (``daemon``), the relay that holds its background transfer until the copy is ready
(``relay``), the watcher that fails a copy closed when its daemon dies (``transfer``), and their
tuning (``tuning``). ``snapctl.activation.restore`` offers it as one of two restore strategies.
"""
