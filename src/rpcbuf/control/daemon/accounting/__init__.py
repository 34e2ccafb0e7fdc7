"""Who holds what, and the bounds on it: the buffer registry, its books and
waiters, leases, range locks, charges, how a buffer gets memory, and room for
unauthenticated peers. Imports only ``observe``.
"""
