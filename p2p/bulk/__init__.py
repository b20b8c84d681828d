"""The bulk data plane: encrypted frames (``frames``, sans-IO), the control messages
(``control``, sans-IO ``p2p.wire`` types), the choice of data connection (``negotiate``,
sans-IO), the shared transfer pieces and loops (``transfer``), data connections dialed, punched
or accepted (``connect``, ``listener``), the negotiation's drivers (``link``), and what is built
on them: one payload (``payload``) and a channel of many (``channel``).
"""
