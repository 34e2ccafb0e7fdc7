"""The fleet registry's I/O (etcd), for daemon and client alike."""
