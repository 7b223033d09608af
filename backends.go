package ecxfer

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ecxfer/ecxfer/internal/testhook"
	"github.com/ecxfer/ecxfer/nixl"
	"github.com/ecxfer/ecxfer/nixl/libnixl"
	"github.com/ecxfer/ecxfer/nixl/loopback"
	"github.com/ecxfer/ecxfer/nixl/ucx"
)

// ErrNoBackend reports a backend that is not available in this build or on
// this machine.
var ErrNoBackend = errors.New("ecxfer: backend not available")

func newAgent(cfg Config) (nixl.Agent, error) {
	testhook.Run(&testhook.NewAgent)
	switch cfg.Backend {
	case "ucx":
		if err := enoughFDs(); err != nil {
			return nil, fmt.Errorf("%w: ucx: %w", ErrEngine, err)
		}
		a, err := ucx.New(ucx.Config{Name: cfg.AgentName, MaxNotif: cfg.Reactor.MaxNotif, NoGather: cfg.NoGather,
			LargeTCPSegments: cfg.LargeTCPSegments})
		if err != nil {
			return nil, fmt.Errorf("%w: ucx: %v", ErrEngine, err)
		}
		if cfg.sharedQueueForTest {
			return sharedQueueAllowed{a}, nil
		}
		return a, nil
	case "loopback":
		a, err := loopback.New(cfg.AgentName)
		if err != nil {
			return nil, fmt.Errorf("%w: loopback: %v", ErrConfig, err)
		}
		return a, nil
	case "nixl":
		a, err := libnixl.New(libnixl.Config{Name: cfg.AgentName, MaxNotif: cfg.Reactor.MaxNotif})
		switch {
		case errors.Is(err, libnixl.ErrNotInstalled), errors.Is(err, libnixl.ErrBadLibrary):
			return nil, fmt.Errorf("%w: nixl: %w", ErrNoBackend, err)
		case err != nil:
			return nil, fmt.Errorf("%w: nixl: %v", ErrEngine, err)
		}
		return a, nil
	}
	return nil, fmt.Errorf("%w: unknown backend %q (want ucx, loopback or nixl)", ErrConfig, cfg.Backend)
}

// sharedQueueAllowed is the ucx agent with the refusal of shared-queue
// peers lifted (nixl.SharedQueueGetter always false). Only tests set
// Config.sharedQueueForTest: on one host, the only real UCX gets that stay
// in flight are the emulated gets of a stopped producer's own memory, and
// the tests of RemoveRemotePeer, Deregister, timeouts and ErrBusy with
// engine requests in flight need them. Those tests never kill the producer.
type sharedQueueAllowed struct{ *ucx.Agent }

func (sharedQueueAllowed) SharedQueueGets(string) bool { return false }

// ucxStartFDs is how many free descriptors New wants before it starts a
// UCX engine: UCX 1.13 opens a dozen or so while it starts (its async
// thread, epoll, shared-memory segments), and when one of those fails it
// aborts the process in an assertion instead of returning an error.
const ucxStartFDs = 64

// enoughFDs reports, as an EMFILE error, a process with fewer than
// ucxStartFDs descriptors left under its soft limit. Best effort: other
// threads may open some meanwhile.
func enoughFDs() error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil || lim.Cur == unix.RLIM_INFINITY {
		return nil
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil // not counted: let UCX try
	}
	open := uint64(len(ents))
	if open+ucxStartFDs <= lim.Cur {
		return nil
	}
	return fmt.Errorf("%d of %d descriptors in use, UCX needs about %d more to start (it aborts the process without them): %w",
		open, lim.Cur, ucxStartFDs, unix.EMFILE)
}
