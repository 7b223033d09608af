// Package testhook holds the points where tests of other packages widen a
// race window that is otherwise too narrow to hit on demand, or see that
// something happened that leaves no other trace. Each is nil outside
// tests; the code that runs one pays an atomic load.
package testhook

import "sync/atomic"

// AfterDirectDone runs between publishing a pool READ of a same-host peer
// DONE and sending its notification, on the goroutine that publishes it
// (the reactor's loop, or the one that copied its last chunk).
var AfterDirectDone atomic.Pointer[func()]

// DirectChunk runs before a chunk of a same-host READ on the copy
// workers is copied, on the goroutine that copies it.
var DirectChunk atomic.Pointer[func()]

// NewAgent runs when New is about to create its engine: tests count the
// engines a refused Config started.
var NewAgent atomic.Pointer[func()]

// PidfdPoll runs when a direct READ, or the reactor's watch of direct
// peers, asks producers' pidfds whether they are alive (no lifeword
// answered): tests count the polls.
var PidfdPoll atomic.Pointer[func()]

// HeldLook runs when the reactor looks at the direct READs it holds behind
// the engine's fences: tests count the looks.
var HeldLook atomic.Pointer[func()]

// RoomWait runs when a Post waiting for room (Options.WaitWhenBusy) has
// found the reactor not closing and is about to try again.
var RoomWait atomic.Pointer[func()]

// PushRefused runs when a Post could not queue its READ and is about to
// take its handle back.
var PushRefused atomic.Pointer[func()]

// BeforeSweep runs on the reactor's loop as Close's teardown is about to
// free the slots of the transfers it ended.
var BeforeSweep atomic.Pointer[func()]

// BeforeDefer runs when an event record noticed off the reactor thread,
// the thread not yet stopped, is about to be handed to it.
var BeforeDefer atomic.Pointer[func()]

// RestartDropped runs on the reactor's loop when a restarted peer has
// been dropped for its new metadata, on an engine that cannot load the
// new beside the old, before the new is loaded.
var RestartDropped atomic.Pointer[func()]

// DirectOpened runs when OpenDirect begins to open a peer's region.
var DirectOpened atomic.Pointer[func()]

// PostChecked runs when a Post has validated its request, before it
// claims a slot.
var PostChecked atomic.Pointer[func()]

// Count makes hook h count its runs until stop is called.
func Count(h *atomic.Pointer[func()]) (n *atomic.Int64, stop func()) {
	n = new(atomic.Int64)
	f := func() { n.Add(1) }
	h.Store(&f)
	return n, func() { h.Store(nil) }
}

// Run runs the hook h points at, if any.
func Run(h *atomic.Pointer[func()]) {
	if f := h.Load(); f != nil {
		(*f)()
	}
}
