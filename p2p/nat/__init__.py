"""Reachability and NAT traversal: dial-back decisions (``reachability``, sans-IO) and service
(``dialback``), relay slots kept for a private peer (``reservations`` sans-IO, ``relay_slots``),
and the connect ladder direct -> relay -> DCUtR (``traversal``).
"""
