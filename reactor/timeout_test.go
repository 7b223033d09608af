package reactor

import (
	"context"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/leakcheck"
	"github.com/ecxfer/ecxfer/nixl/loopback"
)

// waitEnd waits up to 5 s for h to leave StateProc and returns its error;
// it fails the test if h is still in flight then.
func waitEnd(t *testing.T, r *Reactor, h uint64) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := r.Wait(ctx, h)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "transfer still in flight after 5 s")
	return err
}

// inFlight waits until the engine holds n transfers: the reactor has
// posted them, under the timeout in force then.
func inFlight(t *testing.T, r *Reactor, n int64) {
	t.Helper()
	require.Eventually(t, func() bool { return r.inflight.Load() == n }, 5*time.Second, 100*time.Microsecond)
}

// The timeout can change while transfers are in flight: it applies at once
// to every transfer, measured from its post.
func TestTimeoutChangesApplyToTransfersInFlight(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{})
	p.consEng.SetDelay(time.Hour) // nothing completes on its own

	// Posted with the timeout off, then the timeout is set.
	off, err := p.cons.Post(p.pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight(t, p.cons, 1)
	// Posted under a long timeout, then it is shortened.
	p.cons.SetTimeout(time.Hour)
	first, err := p.cons.Post(p.pname, []int{1}, []int{1}, nil)
	require.NoError(t, err)
	inFlight(t, p.cons, 2)
	p.cons.SetTimeout(20 * time.Millisecond)
	second, err := p.cons.Post(p.pname, []int{2}, []int{2}, nil)
	require.NoError(t, err)

	require.ErrorIs(t, waitEnd(t, p.cons, second), ErrTimeout, "a transfer posted behind a longer timeout")
	require.ErrorIs(t, waitEnd(t, p.cons, first), ErrTimeout, "a transfer posted under the longer timeout")
	require.ErrorIs(t, waitEnd(t, p.cons, off), ErrTimeout, "a transfer posted while the timeout was off")
	for _, h := range []uint64{off, first, second} {
		require.NoError(t, p.cons.Release(h))
	}

	// Turned off again: a transfer in flight stays in flight.
	p.cons.SetTimeout(0)
	h, err := p.cons.Post(p.pname, []int{3}, []int{3}, nil)
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond)
	st, err := p.cons.State(h)
	require.NoError(t, err)
	require.Equal(t, StateProc, st)
	require.NoError(t, p.cons.Release(h))
}

// How long an idle reactor may sleep: ParkTimeout, unless something is
// due that no event announces.
func TestParkMillis(t *testing.T) {
	leakcheck.Check(t)
	p := newPair(t, 16, Options{ParkTimeout: 50 * time.Millisecond})
	park := func() (ms int) {
		require.NoError(t, p.cons.do(func() error { ms = p.cons.parkMillis(); return nil }))
		return ms
	}
	require.Equal(t, 50, park())

	// A READ in flight under a timeout meant as "never" does not shorten
	// the sleep (its deadline used to wrap and wake the loop every 1 ms),
	// nor does one far off.
	p.consEng.SetDelay(time.Hour)
	p.cons.SetTimeout(math.MaxInt64)
	h, err := p.cons.Post(p.pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight(t, p.cons, 1)
	require.Equal(t, 50, park())
	p.cons.SetTimeout(time.Hour - time.Millisecond)
	require.Equal(t, 50, park())
	p.cons.SetTimeout(5 * time.Second)
	require.Equal(t, 50, park())
	require.NoError(t, p.cons.Release(h))
	p.cons.SetTimeout(0)

	// Notifications a producer's socket refused are retried every turn,
	// and nothing wakes the loop when that socket drains: at most 1 ms.
	var ms int
	require.NoError(t, p.cons.do(func() error {
		saved := p.cons.dir
		p.cons.dir = &direct{ns: &notifSock{backlog: make([]pendingNotif, 1)}}
		ms = p.cons.parkMillis()
		p.cons.dir = saved
		return nil
	}))
	require.Equal(t, 1, ms)
}

// A ParkTimeout meant as "as long as possible" is capped at 2^30 ms. Its
// rounding used to wrap negative, and the idle loop then woke every 1 ms.
func TestParkMillisLongest(t *testing.T) {
	leakcheck.Check(t)
	for _, tc := range []struct {
		park time.Duration
		want int
	}{
		{math.MaxInt64, 1 << 30},
		{time.Millisecond + 1, 2},
		{time.Nanosecond, 1},
	} {
		r, _ := startLoopback(t, "park", 4, Options{ParkTimeout: tc.park})
		var ms int
		require.NoError(t, r.do(func() error { ms = r.parkMillis(); return nil }))
		require.Equal(t, tc.want, ms, "ParkTimeout %v", tc.park)
	}
}

// quietFDAgent is a loopback agent whose event descriptor never fires
// and always arms, as UCX's does while its gets wait for a peer: the loop
// then parks for ParkTimeout or until the next deadline it knows of,
// where loopback's own fd, busy with the transfer in flight, would keep
// it napping 1 ms at a time.
type quietFDAgent struct {
	*loopback.Agent
	fd int
}

func (a *quietFDAgent) EventFD() int       { return a.fd }
func (a *quietFDAgent) Arm() (bool, error) { return true, nil }

// A timeout set while the loop is parked takes effect then, not when the
// loop next wakes: SetTimeout wakes it to recompute its sleep.
func TestSetTimeoutWakesParkedLoop(t *testing.T) {
	leakcheck.Check(t)
	prod, prodEng := startLoopback(t, "prod", 16, Options{})
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Close(efd) })
	la, err := loopback.New(uniqueName("cons"))
	require.NoError(t, err)
	eng := &quietFDAgent{Agent: la, fd: efd}
	cons, err := Start(eng, Options{Idle: IdlePark, ParkTimeout: time.Minute}, blockSetup(64, 16))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cons.Close() })
	md := loopbackMD(t, prod, prodEng)
	pname, err := cons.AddPeer(md, prod.loc.Load().descs)
	require.NoError(t, err)

	la.SetDelay(time.Hour) // nothing completes on its own
	h, err := cons.Post(pname, []int{0}, []int{0}, nil)
	require.NoError(t, err)
	inFlight(t, cons, 1)
	// Parked for up to ParkTimeout: nothing else would wake it.
	require.Eventually(t, func() bool { return cons.sleeping.Load() }, 5*time.Second, 100*time.Microsecond)
	cons.SetTimeout(time.Millisecond)
	require.ErrorIs(t, waitEnd(t, cons, h), ErrTimeout, "the parked loop slept through the new timeout")
	require.NoError(t, cons.Release(h))
}

// busyArmAgent is a loopback agent whose Arm can be made to refuse, as
// ucx's does when the progress it runs before arming finds a message that
// arrived since the loop's last turn. It records the loop's parks at the
// refusal and at the next Progress.
type busyArmAgent struct {
	*loopback.Agent
	r          *Reactor
	busyOnce   atomic.Bool // refuse the next Arm
	busyAlways atomic.Bool
	armed      atomic.Bool // a refusal happened; the next Progress records
	parksAt    [2]atomic.Uint64
	progressed atomic.Bool
	armedOK    atomic.Bool // the engine armed (which clears the loop's armBusy)
}

func (a *busyArmAgent) Arm() (bool, error) {
	if a.busyAlways.Load() {
		return false, nil
	}
	if a.busyOnce.CompareAndSwap(true, false) {
		a.parksAt[0].Store(a.r.st.parks.Load())
		a.armed.Store(true)
		return false, nil
	}
	ok, err := a.Agent.Arm()
	if ok {
		a.armedOK.Store(true)
	}
	return ok, err
}

func (a *busyArmAgent) Progress() (bool, error) {
	if a.armed.CompareAndSwap(true, false) {
		a.parksAt[1].Store(a.r.st.parks.Load())
		a.progressed.Store(true)
	}
	return a.Agent.Progress()
}

// A loop idle for longer than YieldFor whose engine refuses to arm takes
// another turn at once: what made the engine busy is usually a message
// that just arrived. It used to nap 1 ms first. An engine that stays busy
// with nothing to show still makes the loop nap rather than spin.
func TestBusyArmTakesAnotherTurn(t *testing.T) {
	leakcheck.Check(t)
	la, err := loopback.New(uniqueName("busyarm"))
	require.NoError(t, err)
	eng := &busyArmAgent{Agent: la}
	for _, idle := range []IdleStrategy{IdlePark, IdleHybrid} {
		r, err := Start(eng, Options{Idle: idle}, blockSetup(64, 4))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() }) // on failure; Close is idempotent
		eng.r = r
		for range 5 {
			time.Sleep(5 * time.Millisecond) // idle for longer than YieldFor, parked
			// Parked with the engine armed since the last round's refusal:
			// a loop still busy from it (a thread delayed on a loaded
			// machine) would take the next refusal for a busy engine.
			require.Eventually(t, eng.armedOK.Load, 5*time.Second, 100*time.Microsecond, "%v: the loop never armed", idle)
			eng.progressed.Store(false)
			eng.busyOnce.Store(true)
			r.wake()
			require.Eventually(t, eng.progressed.Load, 5*time.Second, 100*time.Microsecond, "%v: the loop never took a turn after the engine refused to arm", idle)
			require.Equal(t, eng.parksAt[0].Load(), eng.parksAt[1].Load(),
				"%v: the loop napped between the engine's refusal to arm and its next turn", idle)
			eng.armedOK.Store(false)
		}
		eng.busyAlways.Store(true)
		r.wake() // out of its sleep, into the busy engine
		s0 := r.Stats()
		time.Sleep(50 * time.Millisecond)
		s1 := r.Stats()
		eng.busyAlways.Store(false)
		turns, parks := s1.LoopTurns-s0.LoopTurns, s1.Parks-s0.Parks
		t.Logf("%v, engine always busy for 50ms: %d turns, %d naps", idle, turns, parks)
		require.Positive(t, parks, "%v: an engine that never arms made the loop spin", idle)
		require.Less(t, turns, 20*parks+20, "%v: an engine that never arms made the loop spin", idle)
		require.NoError(t, r.Close())
		la, err = loopback.New(uniqueName("busyarm"))
		require.NoError(t, err)
		eng.Agent = la
	}
	require.NoError(t, la.Close())
}
