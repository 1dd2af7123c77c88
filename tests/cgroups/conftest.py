"""The real-CRIU activation tests' fixtures (a state directory, the sessions to stop)."""

from tests.activation.conftest import running, state

__all__ = ["running", "state"]
