"""Averaging a vector across a group: matchmaking (``matchmaking`` sans-IO, ``matchmaking_driver``),
the butterfly all-reduce machine (``allreduce``), what its reducers compute (``aggregation``: the
mean or a Byzantine-robust rule) and its driver (``session`` over
``session_links``, with ``session_wire`` for the wire), the driver's sub-rules (``liveness``, and
``channels`` for kept data channels, held between rounds by ``channel_pool``), payload codecs
(``codec``, ``sparse_codec``, ``payload``), buffers, bandwidth estimates, the aggregation audit
(``audit``), and the public ``Averager`` (``averager``).
"""
