#!/usr/bin/env bash
# natlab.sh - NAT traversal test lab built from Linux network namespaces.
#
#   natlab.sh up [--nat1 MODE] [--nat2 MODE] [--wan-input drop|reject] [--no-c]
#   natlab.sh down                      idempotent teardown (safe to run anytime)
#   natlab.sh status
#   natlab.sh shape ROUTER [delay MS] [jitter MS] [rate RATE] [loss PCT]
#   natlab.sh unshape ROUTER
#   natlab.sh exec NS CMD...            = ip netns exec NS CMD...
#
# NAT MODEs (Linux nf_nat via nftables):
#   prc       masquerade, port preserving: endpoint-INdependent mapping,
#             address+port-dependent filtering ("port-restricted cone"). Default nat1.
#   fullcone  prc + endpoint-independent filtering: an nft dynamic map remembers
#             (mapped udp/tcp port -> LAN host) for outbound flows and DNATs any
#             inbound packet to that port back to the host ("full cone").
#   sym       masquerade fully-random: new random public port per 5-tuple
#             (address+port-dependent mapping = "symmetric"). Default nat2.
#   symhash   masquerade random (hash-based port per 5-tuple; also symmetric).
#
# Topology (all in namespaces; the host's own netns is never touched):
#
#   pub (relay) 198.51.100.1 + .2 ---+
#   c (public)  198.51.100.3 --------+- br-pub 198.51.100.254 [ns inet = "internet" router]
#                                         l-nat1 203.0.113.1/30 --- wan 203.0.113.2 [nat1] lan 192.168.1.1 --- a 192.168.1.10
#                                         l-nat2 203.0.113.5/30 --- wan 203.0.113.6 [nat2] lan 192.168.2.1 --- b 192.168.2.10
#
# Namespace names are prefixed with NATLAB_PREFIX (default "st-", so the project's lab never
# collides with another lab on the same machine). State (pids, mode) lives in NATLAB_RUN, by default
# under /tmp, never in the source tree.
#
# This is swarmtrain's own copy of the lab (tests/natlab/ must work in a clone that lacks ../shared).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PFX=${NATLAB_PREFIX-st-}
RUN=${NATLAB_RUN:-${TMPDIR:-/tmp}/swarmtrain-natlab-${PFX:-none}}
NS_INET=${PFX}inet NS_PUB=${PFX}pub NS_C=${PFX}c
NS_NAT1=${PFX}nat1 NS_NAT2=${PFX}nat2 NS_A=${PFX}a NS_B=${PFX}b
ALL_NS=("$NS_A" "$NS_B" "$NS_C" "$NS_PUB" "$NS_NAT1" "$NS_NAT2" "$NS_INET")

RELAY_IP=198.51.100.1 RELAY_IP2=198.51.100.2 C_IP=198.51.100.3 PUB_GW=198.51.100.254
NAT1_WAN=203.0.113.2 NAT1_GW=203.0.113.1 NAT2_WAN=203.0.113.6 NAT2_GW=203.0.113.5
A_IP=192.168.1.10 B_IP=192.168.2.10

die() { echo "natlab: $*" >&2; exit 1; }
nsx() { ip netns exec "$@"; }
ns_exists() { [ -e "/run/netns/$1" ]; }
sysctl_ns() { nsx "$1" sysctl -qw "$2"; }

# veth pair created directly inside the two namespaces (never in the host netns)
veth() { ip link add name "$2" netns "$1" type veth peer name "$4" netns "$3"; }

router_rules() { # ns lan_subnet mode wan_input
  local ns=$1 lan=$2 mode=$3 wan_input=$4 masq fc_fwd="" fc_pre="" fc_acc="" inp
  case $mode in
    prc|fullcone) masq="masquerade" ;;
    sym)          masq="masquerade fully-random" ;;
    symhash)      masq="masquerade random" ;;
    *) die "unknown NAT mode '$mode' (prc|fullcone|sym|symhash)" ;;
  esac
  if [ "$mode" = fullcone ]; then
    # remember port -> LAN host for every outbound flow (assumes the masquerade
    # preserved the port, which it does unless two LAN hosts collide)
    fc_fwd='
    oifname "wan" meta l4proto udp update @fc_udp { udp sport : ip saddr }
    oifname "wan" meta l4proto tcp update @fc_tcp { tcp sport : ip saddr }'
    fc_pre='
    iifname "wan" meta l4proto udp dnat to udp dport map @fc_udp
    iifname "wan" meta l4proto tcp dnat to tcp dport map @fc_tcp'
    fc_acc='
    iifname "wan" ct status dnat accept'
  fi
  if [ "$wan_input" = reject ]; then inp='iifname "wan" reject'; else inp='iifname "wan" drop'; fi
  nsx "$ns" nft -f - <<EOF
table ip natlab {
  map fc_udp { type inet_service : ipv4_addr; flags dynamic,timeout; timeout 120s; }
  map fc_tcp { type inet_service : ipv4_addr; flags dynamic,timeout; timeout 300s; }
  chain c_prerouting {
    type nat hook prerouting priority dstnat; policy accept;$fc_pre
  }
  chain c_postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" ip saddr $lan $masq
  }
  chain c_forward {
    type filter hook forward priority filter; policy drop;$fc_fwd
    ct state established,related accept
    iifname "lan" oifname "wan" ip saddr $lan accept$fc_acc
  }
  chain c_input {
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" icmp type echo-request accept
    $inp
  }
}
EOF
}

cmd_up() {
  local nat1=prc nat2=sym wan_input=drop with_c=1
  while [ $# -gt 0 ]; do
    case $1 in
      --nat1) nat1=$2; shift 2 ;;
      --nat2) nat2=$2; shift 2 ;;
      --wan-input) wan_input=$2; shift 2 ;;
      --no-c) with_c=0; shift ;;
      *) die "up: unknown arg $1" ;;
    esac
  done
  cmd_down >/dev/null 2>&1 || true      # idempotent: always start from scratch
  mkdir -p "$RUN"
  local ns
  for ns in "${ALL_NS[@]}"; do
    [ "$ns" = "$NS_C" ] && [ $with_c = 0 ] && continue
    ip netns add "$ns"
    ip -n "$ns" link set lo up
  done

  # --- "internet" router with a bridge for the public /24 ---
  ip -n "$NS_INET" link add br-pub type bridge
  ip -n "$NS_INET" addr add $PUB_GW/24 dev br-pub
  ip -n "$NS_INET" link set br-pub up
  for ns in "$NS_INET" "$NS_NAT1" "$NS_NAT2"; do
    sysctl_ns "$ns" net.ipv4.ip_forward=1
    sysctl_ns "$ns" net.ipv4.conf.all.rp_filter=0
    sysctl_ns "$ns" net.ipv4.conf.default.rp_filter=0
  done

  # pub: relay host with two addresses (2nd one for RFC 5780-style mapping tests)
  veth "$NS_PUB" eth0 "$NS_INET" p-pub
  ip -n "$NS_INET" link set p-pub master br-pub up
  ip -n "$NS_PUB" addr add $RELAY_IP/24 dev eth0
  ip -n "$NS_PUB" addr add $RELAY_IP2/24 dev eth0
  ip -n "$NS_PUB" link set eth0 up
  ip -n "$NS_PUB" route add default via $PUB_GW

  if [ $with_c = 1 ]; then
    veth "$NS_C" eth0 "$NS_INET" p-c
    ip -n "$NS_INET" link set p-c master br-pub up
    ip -n "$NS_C" addr add $C_IP/24 dev eth0
    ip -n "$NS_C" link set eth0 up
    ip -n "$NS_C" route add default via $PUB_GW
  fi

  # routers: WAN /30 to the internet router, LAN /24 with one host
  local r wan gw lanip lan host hip n
  for n in 1 2; do
    if [ $n = 1 ]; then r=$NS_NAT1 wan=$NAT1_WAN gw=$NAT1_GW host=$NS_A hip=$A_IP
    else                r=$NS_NAT2 wan=$NAT2_WAN gw=$NAT2_GW host=$NS_B hip=$B_IP; fi
    lanip=192.168.$n.1 lan=192.168.$n.0/24
    veth "$r" wan "$NS_INET" l-nat$n
    ip -n "$NS_INET" addr add $gw/30 dev l-nat$n
    ip -n "$NS_INET" link set l-nat$n up
    ip -n "$r" addr add $wan/30 dev wan
    ip -n "$r" link set wan up
    ip -n "$r" route add default via $gw
    veth "$r" lan "$host" eth0
    ip -n "$r" addr add $lanip/24 dev lan
    ip -n "$r" link set lan up
    ip -n "$host" addr add $hip/24 dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$host" route add default via $lanip
  done
  router_rules "$NS_NAT1" 192.168.1.0/24 "$nat1" "$wan_input"
  router_rules "$NS_NAT2" 192.168.2.0/24 "$nat2" "$wan_input"
  printf 'nat1=%s\nnat2=%s\nwan_input=%s\nwith_c=%s\n' "$nat1" "$nat2" "$wan_input" "$with_c" > "$RUN/state"
  echo "natlab up: nat1=$nat1 nat2=$nat2 wan_input=$wan_input"
}

kill_ns_procs() { # terminate processes living in one of OUR namespaces, by PID
  local ns=$1 pids i
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -z "$pids" ] && return 0
  kill -TERM $pids 2>/dev/null || true
  for i in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] && return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
}

cmd_down() {
  local ns
  for ns in "${ALL_NS[@]}"; do
    ns_exists "$ns" || continue
    kill_ns_procs "$ns"
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f "$RUN"/state "$RUN"/*.pid
  echo "natlab down"
}

cmd_status() {
  local ns
  [ -f "$RUN/state" ] && cat "$RUN/state"
  for ns in "${ALL_NS[@]}"; do
    ns_exists "$ns" || continue
    echo "== $ns"; ip -n "$ns" -br addr | grep -v '^lo'
    tc -n "$ns" qdisc show | grep -v -E 'noqueue|pfifo_fast|^qdisc fq_codel' || true
  done
}

# shape ROUTER [delay MS] [jitter MS] [rate RATE] [loss PCT]
#   rate  -> HTB on both ends of the router's WAN veth (upload: router 'wan' egress,
#            download: internet-side egress).  Kernel, accurate.
#   delay -> userspace TUN delay line (delayline.py) in the internet router,
#            applied in EACH direction (RTT grows by 2*delay), like Mininet's TCLink.
#   loss  -> nft 'numgen random' drop in the internet router, each direction.
cmd_shape() {
  local r=${1:?router}; shift
  local n=${r#"$PFX"}; n=${n#nat}; [ "$n" = 1 ] || [ "$n" = 2 ] || die "shape: router must be nat1|nat2"
  local delay=0 jitter=0 rate="" loss=0
  while [ $# -gt 0 ]; do
    case $1 in
      delay) delay=${2%ms}; shift 2 ;;
      jitter) jitter=${2%ms}; shift 2 ;;
      rate) rate=$2; shift 2 ;;
      loss) loss=${2%\%}; shift 2 ;;
      *) die "shape: unknown arg $1" ;;
    esac
  done
  cmd_unshape "$r" >/dev/null
  local link=l-nat$n rns=$PFX"nat$n" wan
  [ $n = 1 ] && wan=$NAT1_WAN || wan=$NAT2_WAN
  if [ -n "$rate" ]; then
    local pair
    for pair in "$NS_INET:$link" "$rns:wan"; do
      tc -n "${pair%%:*}" qdisc replace dev "${pair#*:}" root handle 1: htb default 1 r2q 1000
      tc -n "${pair%%:*}" class add dev "${pair#*:}" parent 1: classid 1:1 htb rate "$rate" ceil "$rate"
      tc -n "${pair%%:*}" qdisc add dev "${pair#*:}" parent 1:1 handle 10: pfifo limit 2000
    done
  fi
  if [ "$loss" != 0 ]; then
    local th; th=$(python3 -c "print(int(round(float('$loss')*100)))")  # per 10000
    nsx "$NS_INET" nft -f - <<EOF
table ip natlab_loss$n {
  chain c_forward {
    type filter hook forward priority -10; policy accept;
    iifname "$link" numgen random mod 10000 < $th drop
    oifname "$link" numgen random mod 10000 < $th drop
  }
}
EOF
  fi
  if [ "$delay" != 0 ] || [ "$jitter" != 0 ]; then
    local up=dU-nat$n dn=dD-nat$n tu=$((100 + 2*n)) td=$((101 + 2*n))
    ip -n "$NS_INET" tuntap add dev $up mode tun
    ip -n "$NS_INET" tuntap add dev $dn mode tun
    ip -n "$NS_INET" link set $up up
    ip -n "$NS_INET" link set $dn up
    sysctl_ns "$NS_INET" net.ipv4.conf.$up.rp_filter=0
    sysctl_ns "$NS_INET" net.ipv4.conf.$dn.rp_filter=0
    ip -n "$NS_INET" route add default dev $up table $tu
    ip -n "$NS_INET" route add default dev $dn table $td
    local pb=$((1000 * n))
    ip -n "$NS_INET" rule add pref $pb iif $up lookup main          # re-injected: normal routing
    ip -n "$NS_INET" rule add pref $((pb+1)) iif $dn lookup main
    ip -n "$NS_INET" rule add pref $((pb+2)) iif $link lookup $tu   # from router -> delay (up)
    ip -n "$NS_INET" rule add pref $((pb+3)) to $wan lookup $td     # to router   -> delay (down)
    nsx "$NS_INET" python3 "$HERE/delayline.py" "$up:$delay:$jitter" "$dn:$delay:$jitter" \
      >"$RUN/delay-nat$n.log" 2>&1 &
    echo $! > "$RUN/delay-nat$n.pid"
    local i; for i in $(seq 50); do   # wait until the TUN fds are attached
      ip -n "$NS_INET" link show $dn | grep -q NO-CARRIER || break; sleep 0.05; done
  fi
  echo "shaped nat$n: delay=${delay}ms jitter=${jitter}ms rate=${rate:-none} loss=${loss}%"
}

cmd_unshape() {
  local r=${1:?router}; local n=${r#"$PFX"}; n=${n#nat}
  local link=l-nat$n rns=$PFX"nat$n" pidf="$RUN/delay-nat$n.pid"
  if [ -f "$pidf" ]; then
    local pid; pid=$(cat "$pidf")
    # only kill it if it is still our delayline process
    if grep -q delayline "/proc/$pid/cmdline" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    fi
    rm -f "$pidf"
  fi
  tc -n "$NS_INET" qdisc del dev $link root 2>/dev/null || true
  tc -n "$rns" qdisc del dev wan root 2>/dev/null || true
  nsx "$NS_INET" nft delete table ip natlab_loss$n 2>/dev/null || true
  local p; for p in 0 1 2 3; do
    ip -n "$NS_INET" rule del pref $((1000 * n + p)) 2>/dev/null || true
  done
  ip -n "$NS_INET" link del dU-nat$n 2>/dev/null || true
  ip -n "$NS_INET" link del dD-nat$n 2>/dev/null || true
  ip -n "$NS_INET" route flush table $((100 + 2*n)) 2>/dev/null || true
  ip -n "$NS_INET" route flush table $((101 + 2*n)) 2>/dev/null || true
  echo "unshaped nat$n"
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  shape) shift; cmd_shape "$@" ;;
  unshape) shift; cmd_unshape "$@" ;;
  exec) shift; nsx "$@" ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
