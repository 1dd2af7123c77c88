"""Every tuning constant of lazy restores in one place: when a copy restores lazily by default,
which memory stays lazy, and when the background transfer may start (docs/lazy.md says why
each is what it is; docs/history.md has the comparisons that chose them)."""

from __future__ import annotations

# Images with at least this much page data restore lazily unless told otherwise: below it a
# plain restore is as quick to answer and completes sooner (docs/lazy.md, "Default").
LAZY_DEFAULT_MIN_BYTES = 256 * 1024 * 1024
# With at least this much memory left lazy, the background transfer is held back until the
# copy is ready and TRANSFER_AFTER_READY_S more (the request that asked for the copy usually
# follows at once): activation and first answer have both cores. Below it the transfer takes
# about as long as the activation, and holding it back would bring the last page later than a
# plain restore does (figures in docs/lazy.md, step 5).
HOLD_TRANSFER_MIN_BYTES = 1024 * 1024 * 1024
TRANSFER_AFTER_READY_S = 0.05
# A held background transfer starts this long after the restore finished at the latest, even
# if the copy is not ready by then: a server that touches much of its lazy memory while it
# recovers gets it a page per fault while the transfer is held (docs/lazy.md). Long enough for a
# real vLLM's recovery on a busy host: a fault stalled after the release (see relay) waits until
# the transfer reaches its page, up to the whole transfer with a learned working set.
TRANSFER_HOLD_MAX_S = 2.0
# While the transfer is held, how often the threads stalled on a page fault are woken to fault
# again (snapctl.criu.lazy.relay: CRIU's daemon drops a fault it could not copy at once).
FAULT_WAKE_S = 0.01
# How often the inventory gate looks whether the restore has read the inventory image.
GATE_POLL_S = 0.0005
# Below this much lazy memory a whole process is restored eagerly: its faults would each wait
# for a chunk of the background transfer, and restoring it costs little (docs/lazy.md, step 2).
EAGER_PROCESS_BELOW = 64 * 1024 * 1024
# In bigger processes, runs of contiguous lazy memory shorter than this are restored eagerly.
EAGER_RUN_BELOW = 16 * 1024 * 1024
# A process's learned working set (snapctl.criu.lazy.workingset) stops growing at this many
# runs of pages: past it the copies' touches are too scattered for a set to be worth a view of
# its own (and a process with no set yet is not left all lazy to learn one again). Its pages
# are not bounded: where a recovery reads every weight (in-image weights), all of them are the
# set, a few long runs restored eagerly.
WORKING_SET_MAX_RUNS = 256 * 1024
# A copy's faults are added to a working set only if they grow it by more than this fraction:
# a changed set makes the next copy rewrite its pagemaps instead of reading them
# from the view cache, which a few missed pages do not repay.
WORKING_SET_MIN_GROWTH = 0.02
# A copy's working set is what its daemon served as faults until this long after the transfer's
# release: the request that asked for the copy comes right after it is ready.
LEARN_AFTER_RELEASE_S = 1.0
# A transfer that ended before its copy was ready is learned from at the copy's release, if
# that comes within this long of the end: a copy released later was parked (a pool's) with
# its pages in, and what it faulted while parked is not what a copy touches on its way to
# ready (the pages its activation touched had arrived by then, and were no faults).
LEARN_RELEASE_AFTER_END_MAX_S = 10.0
