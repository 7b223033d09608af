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
