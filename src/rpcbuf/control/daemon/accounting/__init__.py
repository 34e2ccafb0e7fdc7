"""Who holds what, and the bounds on it: the buffer registry, its books and
waiters, leases, range locks, how a buffer gets memory, the shared copy threads,
and room for unauthenticated peers. Imports only ``observe``.
"""
