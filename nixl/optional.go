package nixl

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
