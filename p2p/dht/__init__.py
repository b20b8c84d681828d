"""The DHT: signed subkey-dictionary records (``records``, sans-IO) and libp2p's Kademlia on a
host with our validator, merging store, quotas and admission rules (``kademlia``).
"""
