#!/bin/sh
# make bench-hosts: ecxfer between two "hosts" on this machine. Two network
# namespaces joined by a veth pair, created here and removed on exit; the
# harness's producer (ecxfer-bench serve) in one, the consumer (run
# --connect) in the other, UCX over TCP on the veth; the link's own TCP
# throughput and round-trip time measured in the same run, before and
# after, as the limit; then one producer against 1, 4 and 16 consumer
# processes across the same link (ecxfer-fleet consumers).
#
# Each cell of the harness runs in 6 rounds of 0.5 s (make run's: 2), the
# modes in turn: across the link the rows' ratios move by 10-20% from
# one 2-round run to the next, and more rounds keep a run's ratios from
# being decided by which mode the machine's slow spells hit.
#
# The harness's reactors, consumer and producer, run with ecxfer's
# default idle strategy (CONSUMER_IDLE and PRODUCER_IDLE, hybrid), as
# they do unless tuned; README's Tuning says why a producer across hosts
# is left on it (parked, it was slower on one-block READs and no faster
# on the rest). Every reactor of the fleet run parks (HOSTS_IDLE):
# sixteen consumer processes on two cores, each reactor spinning, would
# measure the machine, not the link.
#
# Needs root and iproute2. Environment: GO (go), CONSUMER_IDLE and
# PRODUCER_IDLE (hybrid), HOSTS_IDLE (park), BENCH_FLAGS (extra flags for
# ecxfer-bench run, after the defaults), FLEET_FLAGS (extra flags for
# ecxfer-fleet consumers).
set -eu

GO=${GO:-go}
HOSTS_IDLE=${HOSTS_IDLE:-park}
CONSUMER_IDLE=${CONSUMER_IDLE:-hybrid}
PRODUCER_IDLE=${PRODUCER_IDLE:-hybrid}
ID=$$
NSA=ecxh-p$ID
NSB=ecxh-c$ID
DEVA=$(echo "ecxhp$ID" | cut -c1-15)
DEVB=$(echo "ecxhc$ID" | cut -c1-15)
IPA=10.203.0.1
IPB=10.203.0.2
TMP=""
PIDS=""

cleanup() {
	# A second signal must not cut the clean-up short.
	trap '' INT TERM HUP
	for p in $PIDS; do kill "$p" 2>/dev/null || true; done
	# Whatever else still runs in the namespaces (the consumer processes
	# of a fleet run that died) would keep them, and the veth, alive.
	for ns in "$NSA" "$NSB"; do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
	done
	# Up to 5 s for them to go, then SIGKILL: one that ignores SIGTERM
	# must not keep the namespaces (every process of the run but the
	# builds runs in one of them; an exited one is listed no more).
	i=0
	while [ $i -lt 50 ] && [ -n "$(ip netns pids "$NSA" 2>/dev/null)$(ip netns pids "$NSB" 2>/dev/null)" ]; do
		sleep 0.1
		i=$((i + 1))
	done
	for ns in "$NSA" "$NSB"; do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
	done
	wait 2>/dev/null || true
	ip netns del "$NSA" 2>/dev/null || true
	ip netns del "$NSB" 2>/dev/null || true
	[ -z "$TMP" ] || rm -rf "$TMP"
}
trap cleanup EXIT
# dash runs the EXIT trap only on exit, not when a signal kills it: every
# signal that ends a run (a closed terminal too) goes through exit. It
# runs a trap only once the foreground command has ended, so each long
# step runs in the background and is waited for (step): a signal ends the
# wait at once.
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
TMP=$(mktemp -d)

# step runs a command to its end, as the foreground would, but
# interruptibly (see above); its exit status is the step's.
step() {
	"$@" &
	STEP=$!
	PIDS="$PIDS $STEP"
	wait "$STEP"
	# Ended: by the clean-up its pid may be another process's.
	PIDS=${PIDS% "$STEP"}
}

# listening waits until something in namespace $1 listens on TCP port $2
# (a server started in the background), for at most 30 s.
listening() {
	i=0
	until ip netns exec "$1" ss -Hltn "sport = :$2" | grep -q .; do
		i=$((i + 1))
		[ $i -lt 3000 ] || { echo "bench-hosts: nothing listens on port $2 in $1" >&2; exit 1; }
		sleep 0.01
	done
}

if [ "$(id -u)" != 0 ]; then
	echo "bench-hosts: needs root (network namespaces)" >&2
	exit 1
fi

echo "bench-hosts: building"
step $GO build -o "$TMP/ecxfer-bench" ./cmd/ecxfer-bench
step $GO build -o "$TMP/ecxfer-fleet" ./cmd/ecxfer-fleet

echo "bench-hosts: namespaces $NSA ($IPA on $DEVA) and $NSB ($IPB on $DEVB), one veth pair"
ip netns add "$NSA"
ip netns add "$NSB"
ip link add "$DEVA" netns "$NSA" type veth peer name "$DEVB" netns "$NSB"
ip -n "$NSA" addr add "$IPA/30" dev "$DEVA"
ip -n "$NSB" addr add "$IPB/30" dev "$DEVB"
for x in "$NSA $DEVA" "$NSB $DEVB" "$NSA lo" "$NSB lo"; do
	set -- $x
	ip -n "$1" link set "$2" up
done
# UCX ignores a device whose operational state is not up.
for x in "$NSA $DEVA" "$NSB $DEVB"; do
	set -- $x
	i=0
	until ip -n "$1" -o link show dev "$2" | grep -q "state UP"; do
		i=$((i + 1))
		[ $i -lt 1000 ] || { echo "bench-hosts: $2 not up" >&2; exit 1; }
		sleep 0.01
	done
done

ip netns exec "$NSA" "$TMP/ecxfer-fleet" tcp-serve --listen "$IPA:7101" &
PIDS="$PIDS $!"
listening "$NSA" 7101
probe() {
	echo "bench-hosts: the link itself ($1)"
	step ip netns exec "$NSB" "$TMP/ecxfer-fleet" tcp-probe --connect "$IPA:7101" --duration 2s
}
probe before

echo "bench-hosts: the harness, producer in $NSA, consumer in $NSB, UCX over TCP"
ip netns exec "$NSA" env UCX_TLS=tcp UCX_NET_DEVICES="$DEVA" "$TMP/ecxfer-bench" serve --listen "$IPA:7100" &
PIDS="$PIDS $!"
listening "$NSA" 7100
# shellcheck disable=SC2086
step ip netns exec "$NSB" env UCX_TLS=tcp UCX_NET_DEVICES="$DEVB" "$TMP/ecxfer-bench" run --connect "$IPA:7100" --no-refs \
	--idle "$CONSUMER_IDLE" --producer-idle "$PRODUCER_IDLE" --duration 3s --rounds 6 ${BENCH_FLAGS:-}

echo "bench-hosts: one producer in $NSA, consumer processes in $NSB"
# shellcheck disable=SC2086
step "$TMP/ecxfer-fleet" consumers --producer-netns "$NSA" --producer-dev "$DEVA" \
	--consumer-netns "$NSB" --consumer-dev "$DEVB" --idle "$HOSTS_IDLE" ${FLEET_FLAGS:-}

probe after
echo "bench-hosts: done; removing the namespaces"
