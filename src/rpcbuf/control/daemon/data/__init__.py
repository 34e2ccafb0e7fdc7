"""How the bytes of a data op move: the one pipeline (``pipeline``: admit,
lock, move, verify, answer) over the data paths (``paths``: UCX, same-host
staging), and the same-host handle channel (``handles``).
"""
