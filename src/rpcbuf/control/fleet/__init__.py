"""The fleet registry's I/O (etcd), shared by the daemon (registration) and
the client (discovery); the record format is ``rpcbuf.control.wire.membership``.
Imports neither side nor the CLI."""
