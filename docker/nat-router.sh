#!/bin/sh
# nat-router LAN_CIDR [prc|sym]: make this container a home router for LAN_CIDR.
#
# Everything from the LAN to any other address is forwarded and masqueraded (source address
# rewritten to this router's address on the outgoing network); replies come back through
# conntrack; nothing from outside reaches the LAN unsolicited (forward policy drop), and the
# router itself accepts no new connection from outside. The rules match the LAN by subnet, not
# by interface name, because Docker does not promise which network becomes eth0.
#
#   prc  masquerade, port preserving: endpoint-independent mapping, address+port-dependent
#        filtering ("port-restricted cone", most home routers; hole punching works)
#   sym  masquerade fully-random: a new public port per destination ("symmetric", carrier-grade
#        NAT; hole punching fails, peers fall back to the relay)
#
# These are the NAT lab's modes (tests/natlab/natlab.sh). Needs cap_add NET_ADMIN and the sysctl
# net.ipv4.ip_forward=1. The counters are what tests/natlab/test_compose.py reads to see that
# traffic was NATed: `nft list table ip swarmtrain_nat`.
set -eu

lan=${1:?usage: nat-router LAN_CIDR [prc|sym]}
mode=${2:-prc}
case $mode in
    prc) masq="masquerade" ;;
    sym) masq="masquerade fully-random" ;;
    *) echo "nat-router: unknown mode '$mode' (prc|sym)" >&2; exit 2 ;;
esac
if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != 1 ]; then
    echo "nat-router: IP forwarding is off (sysctls: net.ipv4.ip_forward: 1)" >&2
    exit 1
fi

nft -f - <<RULES
table ip swarmtrain_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr $lan ip daddr != $lan counter $masq comment "nated"
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        ip saddr $lan ip daddr != $lan accept
        counter comment "unsolicited"
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iif lo accept
        ct state established,related accept
        ip saddr $lan accept
        icmp type echo-request accept
        counter drop
    }
}
RULES
echo "nat-router: $lan masqueraded ($mode)" >&2

# Stay up as the container's process; leave at once on docker stop (SIGTERM) or Ctrl+C.
sleeper=
trap '[ -z "$sleeper" ] || kill "$sleeper" 2>/dev/null; exit 0' INT TERM
while :; do
    sleep 3600 &
    sleeper=$!
    wait "$sleeper" || true
done
