"""The commands behind ``swarmtrain <command>``: coordinator, node, local, status, relay, doctor,
verify. Each parses nothing (``cli`` does) and runs one role.
"""
