"""Small servers the tests run as programs (``python tests/servers/NAME.py``), and what they
share (``capture_stub``, imported as their sibling: they run as scripts, not as ``tests.*``)."""
