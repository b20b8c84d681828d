"""Verified runs: which tasks are re-executed and how verdicts are decided (``plan``, pure), a
volunteer's side (``volunteer``, ``task``) and the coordinator's referee service (``referee``).
"""
