"""The daemon (``rpcbufd``), in rooms, each importing only the rooms below it
(``tests/test_imports.py`` holds the order):

- ``service``: the command line, the ``Daemon`` with its listeners and lifecycle,
  the fleet registry entry, systemd, the state gauges;
- ``sessions``: one session per control connection: intake, hello, dispatch;
- ``ops``: what each verb does;
- ``data``: the one data pipeline over the data paths;
- ``content``: bytes known by hash, on disk, by key, and the model files;
- ``accounting``: who holds what and the bounds on it;
- ``observe``: the logs, the audit trail, the op counters.

Never imports ``rpcbuf.control.client`` or ``rpcbuf.cli``.
"""
