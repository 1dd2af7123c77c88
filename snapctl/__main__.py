"""``python -m snapctl``: the same entry point as the ``snapctl`` script."""

from snapctl.cli import main

raise SystemExit(main())
