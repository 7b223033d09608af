package enginekit

import "github.com/ecxfer/ecxfer/nixl"

// Completions queues finished transfers until PollCompletions reports
// them. Each entry carries the post generation of its request, so an entry
// is dropped, not reported, once its request was released or posted again.
type Completions struct {
	q []pending
}

type pending struct {
	id  nixl.XferID
	gen uint64
	err error
}

// Live reports whether request id is still Done from the post numbered
// gen, i.e. whether a queued completion for it may be reported.
type Live func(id nixl.XferID, gen uint64) bool

// Push queues the completion of post gen of request id.
func (c *Completions) Push(id nixl.XferID, gen uint64, err error) {
	c.q = append(c.q, pending{id: id, gen: gen, err: err})
}

// Len returns how many completions are queued, live or not.
func (c *Completions) Len() int { return len(c.q) }

// Reset empties the queue and drops its storage.
func (c *Completions) Reset() { c.q = nil }

// Poll copies the live queued completions into dst, in order, and returns
// how many it copied; entries it looked at are removed, the rest stay.
func (c *Completions) Poll(dst []nixl.Completion, live Live) int {
	n, k := 0, 0
	for ; k < len(c.q) && n < len(dst); k++ {
		e := c.q[k]
		if !live(e.id, e.gen) {
			continue
		}
		dst[n] = nixl.Completion{ID: e.id, Err: e.err}
		n++
	}
	c.q = c.q[:copy(c.q, c.q[k:])]
	return n
}

// Compact drops the completions nobody can receive any more (released or
// reposted requests), so callers that only use XferStatus do not make the
// queue grow.
func (c *Completions) Compact(live Live) {
	k := 0
	for _, e := range c.q {
		if live(e.id, e.gen) {
			c.q[k] = e
			k++
		}
	}
	c.q = c.q[:k]
}
