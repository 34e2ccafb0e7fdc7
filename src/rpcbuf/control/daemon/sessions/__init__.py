"""One ``Session`` per control connection: intake, back-pressure and the
eager start of each op (``intake``), the hello (``greeting``, ``hello``),
dispatch (``session``).
"""
