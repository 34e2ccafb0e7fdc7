"""The daemon (``rpcbufd``): listeners and sessions (``server``), the data
operations (``dataops``, ``dedupops``), the registry and its locks, the
content index and disk cache, logs, metrics, systemd notification and
configuration; ``main`` is the command line.  ``python -m control.daemon``
runs it.  Never imports ``control.client`` or ``control.cli``.
"""
