package reactor

import (
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/ecxfer/ecxfer/internal/affinity"
	"github.com/ecxfer/ecxfer/nixl"
)

// IdleStrategy says what the reactor does when a loop turn found no work.
// With IdleHybrid and IdlePark, while direct READs are on the copy
// workers and nothing else needs the loop, the thread instead sleeps
// with its goroutine blocked, its P free for the copy, for at most 1 ms
// (copyNap): the goroutine that copies a READ's last chunk publishes its
// end itself (Stats.FinisherEnds), and a Post submits its READ itself.
// With Options.ReactorOnly, or an engine that allows no other thread,
// the thread sleeps so only beside READs of 8 MiB or more in all, and a
// copy's end wakes it.
type IdleStrategy uint8

const (
	// IdleHybrid spins for SpinFor after the last work, then yields the
	// CPU between turns until YieldFor, then parks. The default.
	IdleHybrid IdleStrategy = iota
	// IdleSpin never gives the CPU up: the lowest latency, a whole core.
	IdleSpin
	// IdleYield yields the CPU between idle turns and never sleeps.
	IdleYield
	// IdlePark sleeps on the engine's event fd and the submission eventfd
	// as soon as a turn finds nothing to do.
	IdlePark
)

func (s IdleStrategy) String() string {
	switch s {
	case IdleHybrid:
		return "hybrid"
	case IdleSpin:
		return "spin"
	case IdleYield:
		return "yield"
	case IdlePark:
		return "park"
	}
	return fmt.Sprintf("IdleStrategy(%d)", uint8(s))
}

// ParseIdle parses "hybrid", "spin", "yield" or "park".
func ParseIdle(s string) (IdleStrategy, error) {
	for _, v := range []IdleStrategy{IdleHybrid, IdleSpin, IdleYield, IdlePark} {
		if v.String() == s {
			return v, nil
		}
	}
	return 0, fmt.Errorf("%w: idle strategy %q (want hybrid, spin, yield or park)", errUnsupportedOption, s)
}

// Options tune the reactor. The zero value is usable: an unpinned thread,
// the hybrid idle strategy and the defaults below.
type Options struct {
	// PinCPU pins the reactor's OS thread to CPU.
	PinCPU bool
	CPU    int
	// BindNUMA makes the reactor NUMA-aware: without PinCPU it pins the
	// thread to a CPU of NUMANode, and the transport binds its region's
	// pages to that node (the whole pages inside a caller's Region that
	// does not start or end on a page boundary).
	BindNUMA bool
	NUMANode int

	// Idle is the idle strategy; SpinFor and YieldFor are its thresholds
	// (defaults 50µs and 1ms), ParkTimeout the longest sleep (default
	// 50ms; sleeps are also cut short by the next transfer deadline).
	Idle        IdleStrategy
	SpinFor     time.Duration
	YieldFor    time.Duration
	ParkTimeout time.Duration

	// WaitSpin is how long Wait keeps checking a transfer, yielding the
	// processor between checks, before it blocks (default 50µs). Waking a
	// blocked goroutine costs tens of microseconds on a machine whose
	// other cores are idle, so a transfer that completes within WaitSpin
	// is seen without that cost.
	WaitSpin time.Duration

	// ReactorOnly keeps the engine on the reactor thread. Without it, and
	// with an engine that allows it (nixl.AnyThread: the ucx and loopback
	// engines do), a caller that finds an engine READ in flight (State,
	// Wait's spin) takes one step of the loop's engine work itself when
	// the reactor thread is not in a turn: it posts what is queued,
	// progresses the engine and publishes what ended. Only for one READ
	// polled at a time: the READ checked last (or just posted), while at
	// most one READ per two Ps (GOMAXPROCS) is in flight or queued, and
	// not within 10ms of seeing two READs polled in turn. While a caller
	// does that in a loop (a few checks in a row, each within 200µs of
	// the last), the reactor thread, unless its Idle strategy is
	// IdleSpin, leaves the engine's progress to it and naps, looking
	// every 10ms whether the caller still polls and taking no turn while
	// it does (until a READ's timeout is due at the latest), so a polling
	// caller and the engine share one core rather than two, as a caller
	// of raw engine calls does. A READ whose caller stops polling it, and
	// whatever else arrives for the engine after that (notifications, a
	// peer's error), is taken over at the reactor thread's next turn,
	// within 20ms; a Wait that stops spinning
	// to sleep, a new READ, a release, a control operation and a second
	// READ polled wake it at once.
	ReactorOnly bool

	// BatchSize is the most submissions one loop turn takes (default 64).
	BatchSize int
	// SubmitRing is the submission ring's capacity (default 4096, at most
	// 2^20).
	SubmitRing int
	// Handles is the handle table's capacity: the most transfers that can
	// be posted and not yet released (default 4096; rounded up to a power
	// of two, at least 256, at most 2^20: a slot, the index buffers it
	// keeps and its places on the rings take about 600 bytes, so 2^20 of
	// them about 600 MiB). Post
	// returns ErrBusy when all are taken, or
	// when the submission ring is full (possible when SubmitRing is
	// smaller than Handles).
	Handles int
	// WaitWhenBusy makes Post wait for room instead of returning ErrBusy
	// when the ring or the table is full. A waiting Post yields, then
	// sleeps up to 1ms at a time, and returns ErrClosed if the reactor
	// closes meanwhile.
	WaitWhenBusy bool
	// MaxNotif is the longest notification accepted (default
	// nixl.DefaultMaxNotif, 64 KiB; at most MaxNotifLimit), both ways:
	// Post refuses longer ones, and longer ones received from a peer
	// configured with a larger limit are dropped and counted
	// (Stats.NotifsOversized), never handed out. ecxfer.New configures the
	// ucx and nixl engines with the same limit.
	MaxNotif int

	// Logger receives the reactor's structured events (the Event*
	// constants); nil means silent. Records are emitted on the reactor
	// thread, rarely (never per READ), so a slow handler only delays the
	// loop when something noteworthy happens; events noticed elsewhere (by
	// a caller taking a step of the loop's work, or the copy worker that
	// finished a READ) are handed to the thread, which writes them on its
	// next turn. A handler may call the reactor's methods: Release of a
	// READ in flight does not wait there, and those that would wait for
	// the thread (AddPeer, RemovePeer, Close, Wait and WaitNotifs when they
	// would block, a Post waiting for room) return ErrReactorThread.
	Logger *slog.Logger
}

// MaxNotifLimit is the largest MaxNotif: the longest notification the
// engines accept (their own cap, in nixl/internal/enginekit, is the same).
const MaxNotifLimit = 1 << 20

// Check reports whether the options are usable, without starting anything:
// every size and threshold in range, and the CPU or NUMA node to pin to
// available to the calling thread. Start checks them too; calling Check
// first lets a caller refuse bad options before it creates an engine.
func (o Options) Check() error {
	o, err := o.withDefaults()
	if err != nil {
		return err
	}
	if o.PinCPU {
		allowed, err := affinity.Allowed()
		if err != nil {
			return err
		}
		if !slices.Contains(allowed, o.CPU) {
			return fmt.Errorf("%w: CPU %d is not available (allowed: %v)", errUnsupportedOption, o.CPU, allowed)
		}
	}
	if o.BindNUMA {
		// The region's pages go to the node even when PinCPU picks the
		// thread's CPU; without PinCPU the thread needs a CPU there.
		var err error
		if o.PinCPU {
			_, err = affinity.NodeCPUs(o.NUMANode)
		} else {
			_, err = affinity.PickCPU(o.NUMANode)
		}
		if err != nil {
			return fmt.Errorf("%w: %v", errUnsupportedOption, err)
		}
	}
	return nil
}

// maxTable bounds Handles and SubmitRing. The old bound, 2^24, let a
// config ask for a table of gigabytes, allocated at Start.
const maxTable = 1 << 20

func (o Options) withDefaults() (Options, error) {
	if o.SpinFor == 0 {
		o.SpinFor = 50 * time.Microsecond
	}
	if o.WaitSpin == 0 {
		o.WaitSpin = 50 * time.Microsecond
	}
	if o.YieldFor == 0 {
		o.YieldFor = time.Millisecond
	}
	if o.ParkTimeout == 0 {
		o.ParkTimeout = 50 * time.Millisecond
	}
	if o.BatchSize == 0 {
		o.BatchSize = 64
	}
	if o.SubmitRing == 0 {
		o.SubmitRing = 4096
	}
	if o.Handles == 0 {
		o.Handles = 4096
	}
	if o.MaxNotif == 0 {
		o.MaxNotif = nixl.DefaultMaxNotif
	}
	switch {
	case o.SpinFor < 0 || o.YieldFor < 0 || o.ParkTimeout < 0:
		return o, fmt.Errorf("%w: negative idle threshold", errUnsupportedOption)
	case o.WaitSpin < 0:
		return o, fmt.Errorf("%w: negative WaitSpin", errUnsupportedOption)
	case o.Idle > IdlePark:
		return o, fmt.Errorf("%w: idle strategy %d", errUnsupportedOption, o.Idle)
	case o.BatchSize < 0 || o.BatchSize > 1<<16:
		return o, fmt.Errorf("%w: batch size %d (1..65536)", errUnsupportedOption, o.BatchSize)
	case o.SubmitRing < 0 || o.SubmitRing > maxTable:
		return o, fmt.Errorf("%w: submit ring %d (1..2^20)", errUnsupportedOption, o.SubmitRing)
	case o.Handles < 0 || o.Handles > maxTable:
		return o, fmt.Errorf("%w: handle table %d (1..2^20)", errUnsupportedOption, o.Handles)
	case o.MaxNotif < 0 || o.MaxNotif > MaxNotifLimit:
		return o, fmt.Errorf("%w: max notification %d (1..%d)", errUnsupportedOption, o.MaxNotif, MaxNotifLimit)
	case o.PinCPU && o.CPU < 0:
		return o, fmt.Errorf("%w: CPU %d", errUnsupportedOption, o.CPU)
	case o.BindNUMA && o.NUMANode < 0:
		return o, fmt.Errorf("%w: NUMA node %d", errUnsupportedOption, o.NUMANode)
	}
	return o, nil
}
