"""snapctl: capture an initialized inference server once with CRIU, start copies of it fast.

The package is split by concern; each subpackage's docstring says what it owns:
``protocol`` (v1 control files), ``launcher`` (server side of the protocol), ``criu``,
``namespaces``, ``images``, ``activation``, ``supervision``, ``qualification`` and ``cli``.
"""

__version__ = "0.1.0"
