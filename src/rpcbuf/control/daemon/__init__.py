"""The daemon (``rpcbufd``), in rooms, each importing only the rooms below it
(``tests/test_imports.py`` holds the order):

- ``service``: the shell: the command line (``main``, ``flags``, ``config``),
  the ``Daemon`` with its listeners and lifecycle (``server``), the fleet
  registry entry (``announce``), systemd (``sdnotify``), the state gauges;
- ``sessions``: one ``Session`` per control connection: reading,
  back-pressure and the eager start of each op (``intake``), the hello
  (``greeting``, ``hello``) and dispatch (``session``);
- ``ops``: what each verb does (``controlops``, ``dataops``, ``dedupops``,
  ``blockops``, ``attachops``, ``fileops``), against ``node.Node``;
- ``data``: the one data pipeline (``pipeline``) over the data paths
  (``paths``: UCX, same host) and the same-host handle channel (``handles``);
- ``content``: what bytes are held by hash (``index``), on disk
  (``diskcache``), by key (``blocks``) and which files loads may read
  (``modeldirs``);
- ``accounting``: who holds what: the buffer registry and its pools, leases,
  locks and waiters, how a buffer gets memory (``backing``, ``prefault``),
  the copy threads shared fairly (``copypool``), bounded room for peers not
  yet authenticated (``admission``);
- ``observe``: the logs and the audit trail, the op counters.

``python -m rpcbuf.control.daemon`` runs it.  Never imports
``rpcbuf.control.client`` or ``rpcbuf.control.cli``.
"""
