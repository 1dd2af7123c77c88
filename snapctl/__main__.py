"""``python -m snapctl``: the same entry point as the ``snapctl`` script."""

from snapctl.entry import main

raise SystemExit(main())
