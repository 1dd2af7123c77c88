"""What a restore depends on outside the image (kernel and its features, CRIU, CPU, server
argv, Python, and every file the captured tree had mapped or open), what is recorded only to be
shown (machine id, hostname, the server's environment), how both are read from a running tree
and from this host, and how two records are compared.

The record is taken just before the dump and checked by every copy before CRIU runs. Fields a
restored tree runs on refuse a copy that differs (some may be waived by name); fields that only
describe where and how the capture ran are shown as notes and never refuse: a fleet restores on
other machines, from shells, units and pods whose environment is not the capture's, and a
restored tree keeps the environment it was captured with whatever the restorer's is.

A difference names the field (and the file or variable), never a value that could be secret:
environment values are stored only as salted sha256, argv with secret flags redacted.

Modules: ``models`` (the record), ``host`` (reading this host's identity), ``tree`` (a process
tree's mapped and open files and their content digests) and ``compare`` (the comparison,
waivers, refusal and notes).
"""
