"""A DiLoCo volunteer's rounds: the node's training loop (``node``) and the averaging hook it
hands DiLoCo (``swarm_average``).
"""
