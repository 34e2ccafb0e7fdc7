"""One ``Session`` per control connection (``session``): its hello
(``greeting``), its ops (``inflight``), and how connections come in (``intake``).
"""
