"""The daemon (``rpcbufd``): the listeners and lifecycle (``server``), one
``session`` per connection with its quick ops (``controlops``) and hello
(``hello``), the data ops (``dataops``, ``dedupops``) run by one data
pipeline (``pipeline``) over the data paths (``paths``: UCX, same host), the
registry and its locks, the content index and disk cache, logs, metrics,
systemd notification and configuration; ``main`` is the command line.
``python -m rpcbuf.control.daemon`` runs it.  Never imports ``rpcbuf.control.client`` or
``rpcbuf.control.cli``.
"""
