#!/bin/sh
# swarmtrain-entrypoint: the image's ENTRYPOINT. Runs the service's command, after pointing the
# default route at the NAT router when SWARM_GATEWAY is set (the volunteers: their LAN's way out
# is the router container, not Docker's own gateway, so every packet they send to the public
# network is masqueraded by it). Changing a route needs `cap_add: [NET_ADMIN]`.
#
# tests/natlab/test_compose.py runs this same file in a network namespace.
set -eu

if [ -n "${SWARM_GATEWAY:-}" ]; then
    if ! ip route replace default via "$SWARM_GATEWAY"; then
        echo "swarmtrain-entrypoint: cannot route via $SWARM_GATEWAY (does the service have" \
            "cap_add: [NET_ADMIN], and is the gateway on one of its networks?)" >&2
        exit 1
    fi
    echo "swarmtrain-entrypoint: default route via $SWARM_GATEWAY" >&2
fi
exec "$@"
