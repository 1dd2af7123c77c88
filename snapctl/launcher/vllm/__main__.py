"""Entry point: ``python -m snapctl.launcher.vllm serve MODEL ...``."""

import sys

from snapctl.launcher.vllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
