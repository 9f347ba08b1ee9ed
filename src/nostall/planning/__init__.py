"""The planning layer: which rank writes which bytes (the save plan, replica deduplication) and
the collectives the ranks agree on it with. On top of :mod:`nostall.core`; it touches no storage.
"""
