package nixl

import "github.com/ecxfer/ecxfer/descriptors"

// The interfaces below are optional: an engine implements them when it
// can, and callers check with a type assertion.

// NotifDropper is implemented by engines that can lose notifications
// after they reached this process (a message the engine could not accept
// or could not parse). DroppedNotifs counts them since the agent was
// created, and keeps its value after Close; it never decreases. A
// notification a peer never sent, or that the network lost on the way, is
// not counted: nothing here saw it.
type NotifDropper interface {
	DroppedNotifs() uint64
}

// NotifUndeliverer is implemented by engines that hold notifications back
// when a peer cannot take them yet, and so may drop some unsent: their
// peer died, or went away before they could go. UndeliveredNotifs counts
// them since the agent was created (those still held when it closes
// included) and keeps its value after Close; it never decreases.
type NotifUndeliverer interface {
	UndeliveredNotifs() uint64
}

// SharedQueueGetter is implemented by engines that can tell, for a loaded
// peer, whether its gets are served by the peer writing into a receive
// queue in shared memory that this process shares with all its same-host
// peers. UCX 1.13 does that for memory the peer registered itself (not
// memory the engine allocated): the peer answers each get with messages.
// A peer that dies in the middle of such a reply (SIGKILL, or SIGBUS from
// its own truncated file) can leave the queue stuck, and then transfers
// from every other peer stop too. Callers that have another way to read
// such a peer use it, and refuse the peer otherwise.
type SharedQueueGetter interface {
	SharedQueueGets(peerName string) bool
}

// LocalFencer is implemented by engines that may still write local memory
// after the READ that asked for it has ended: a READ released, or ended by
// a timeout, while requests of it were outstanding that the engine cannot
// take back, whose data may arrive later. Such memory is fenced until
// they have ended, and the engine holds its own later READs into it.
// Callers that write local memory another way (a copy of their own) check
// it first and hold those writes too.
type LocalFencer interface {
	// Fencing reports whether any local memory is fenced now. Any
	// goroutine may call it; it is one atomic load. It becomes true
	// before the READ whose end fenced the memory is reported ended.
	Fencing() bool
	// Fenced reports whether [addr, addr+n) may overlap fenced local
	// memory. Any goroutine may call it. It never answers false for
	// memory fenced before the call began; for a short while after a
	// change of the fences (until the engine next progresses) it may
	// answer true for memory no fence covers.
	Fenced(addr, n uint64) bool
	// FenceVersion changes whenever Fenced's answers may have changed.
	// Any goroutine may call it.
	FenceVersion() uint64
}

// ProcessNamer is implemented by engines whose metadata names the process
// that made it. MetadataProcess decodes only (it touches no state of the
// agent, so any goroutine may call it) and reports the process id and
// start time (clock ticks after boot) the metadata carries; ok is false
// when the metadata does not decode or names none. A caller that learns
// of the same process another way (an advertisement of its region) checks
// that both name the same one.
type ProcessNamer interface {
	MetadataProcess(md []byte) (pid, start uint64, ok bool)
}

// MetadataStager is implemented by engines that can load changed metadata
// of a loaded peer beside that peer, so that replacing a peer (after it
// restarted) is one step: the new metadata is loaded and its block list
// prepared while the old peer is left as it is, and only then does the
// new peer take the name. Metadata that fails to load, or a block list that
// does not fit it, leaves the old peer working. StageRemoteMetadata fails
// with ErrNotFound when md names no loaded peer, and with ErrInvalidParam
// when md is what that peer was loaded from.
type MetadataStager interface {
	StageRemoteMetadata(md []byte) (StagedPeer, error)
}

// StagedPeer is a peer loaded by StageRemoteMetadata, not yet under its
// name. Exactly one of Commit and Abort ends it; both are idempotent and
// the first one decides.
type StagedPeer interface {
	// Name is the name the peer will take (the old peer's).
	Name() string
	// SharedQueueGets is SharedQueueGetter's answer for the new peer.
	SharedQueueGets() bool
	// PrepDlist prepares a list of the new peer's memory, as
	// Agent.PrepDlist would once it is loaded.
	PrepDlist(descs descriptors.List, mem MemType) (DlistID, error)
	// Commit invalidates the old peer, as InvalidateRemoteMetadata does
	// (its transfers fail, its lists become unusable), and loads the new
	// one under the name, with the lists prepared on it.
	Commit()
	// Abort closes the new peer; the old one is untouched. Lists prepared
	// on the new peer become unusable and are still to be released.
	Abort()
}

// AnyThread is implemented by engines that may be driven by different
// threads at different times, one at a time (the Agent contract's "one
// goroutine" relaxed to "one goroutine at a time", with the hand-over
// ordered by the caller's synchronisation). AnyThread reports whether
// this agent allows it. The reactor then lets a caller polling a READ
// advance the engine itself while the reactor thread stands aside.
type AnyThread interface {
	AnyThread() bool
}

// GatherCounter is implemented by engines that gather READs: a READ of
// many ranges asked for in a few messages, which the peer answers with the
// bytes (ucx, peers on other hosts). GatherCounts counts them since the
// agent was created; the counts keep their values after Close and never
// decrease.
type GatherCounter interface {
	GatherCounts() GatherCounts
}

// GatherCounts are the counters of gathered READs.
type GatherCounts struct {
	// As producer: requests answered with their bytes; refused because
	// the answers in flight reached the engine's bound (the consumer asks
	// again shortly); refused as malformed or reaching outside the
	// registered memory (the consumer's READ fails); not answered at all
	// (no way to answer, out of memory, or the consumer's endpoint failed
	// in the middle of the answers).
	Served, Busy, Refused, Dropped uint64
	// As consumer: answers that came for READs no longer waiting (they
	// were released); answers that did not fit the READ they named (the
	// READ fails); requests asked again after a producer refused them as
	// busy.
	Late, Bad, Retries uint64
	// As producer: answers (of up to 60 KiB each) sent straight out of the
	// registered memory, their bytes in one piece of it, and answers
	// copied into a buffer first because their bytes lay in several
	// (scattered blocks of 60 KiB or less).
	ZeroCopy, Copied uint64
}
