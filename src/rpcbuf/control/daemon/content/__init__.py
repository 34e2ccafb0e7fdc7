"""Bytes known by what they hold: the content index by hash (``index``), the
on-disk cache (``diskcache``), the keyed block tier (``blocks``), and which
files node-local loads may read (``modeldirs``).
"""
