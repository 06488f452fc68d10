"""Recorded schedules and their replay: chain traces (:mod:`~refspec.traces.chain`), tree traces
(:mod:`~refspec.traces.tree`, :mod:`~refspec.traces.tree_checks`), and the replays behind
``python -m refspec replay`` (:mod:`~refspec.traces.replay`, :mod:`~refspec.traces.replay_tree`).

Instruments, not rules: a learner reading the reference can skip this package.
"""
