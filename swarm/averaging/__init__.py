"""Averaging a vector across a group: matchmaking (``matchmaking`` sans-IO, ``matchmaking_driver``),
the butterfly all-reduce machine (``allreduce``) and its driver (``session``), payload codecs
(``codec``, ``payload``), buffers, bandwidth estimates, kept channels, the aggregation audit
(``audit``), and the public ``Averager`` (``averager``).
"""
