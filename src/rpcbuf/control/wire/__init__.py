"""What daemon and client share, with no I/O and no side: frames, messages and
their fields, run planning, the manifest, the errors, tokens, the registry
record, units and the release.  Imports no daemon, client
or cli module (tests/test_imports.py).
"""
