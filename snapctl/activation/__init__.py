"""Activating a captured tree: the donor (the original, continuing after the dump) or a copy
(restored from an image), each in its own namespaces and directories.

``handshake`` speaks the capturer side of the v1 protocol and probes public HTTP readiness;
``native`` is the device step (``none`` or NVIDIA's ``cuda-checkpoint``); ``session`` owns a
running activation (processes, mounts, publisher) and its stop and cleanup audit; ``donor`` and
``copy`` orchestrate the two kinds.
"""
