"""One ``Session`` per control connection: intake and back-pressure, the hello,
dispatch, and the eager start of each op.
"""
