"""A run directory as its user meets it: one job holds it, and the run ends with where everything is.

    lock.py      one job per run directory (tessera.lock, taken before anything is written)
    summary.py   the lines a run prints at its end: checkpoints, export, metrics, time

May import checkpoint/source.py only (what the directory's checkpoints hold); recipes/train.py uses both.
"""
