"""Who holds what, and the bounds on it: the buffer registry and its pools,
leases, byte-range locks and memory waiters, how a new buffer gets memory,
the copy threads shared fairly among tenants, and bounded room for peers
that have not authenticated. Imports only ``observe``.
"""
