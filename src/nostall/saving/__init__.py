"""The save pipeline: the saver on each rank (:mod:`.saver`), the staging area the trainer copies
tensors into (:mod:`.area`), the background writer process (:mod:`.background`, :mod:`.writer`:
it never imports torch), data and side files, and the commit (:mod:`.commit`).
"""
