"""Who is in a run and which state it holds: progress records (``progress``), the membership
rules (``plan``, pure), catching up, re-syncing and lingering (``elastic``), and state transfer
(``state_sync_plan`` pure, ``state_sync``).
"""
