"""How we know results are honest: reproducible operators (RepOps), commitments, the Verde dispute
game and its referee.

``verify.repops`` imports no networking at all; the dispute game is a sans-IO state machine and its
trio driver speaks over ``p2p``. This package imports nothing of ``diloco`` or ``swarm``.
"""
