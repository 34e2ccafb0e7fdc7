"""The daemon's records of what happened: the log and the audit trail (``logs``),
the op counters and latency histograms (``metrics``). Imports no other room.
"""
