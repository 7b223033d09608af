package main

import (
	"sync"

	"golang.org/x/sys/unix"
)

// The message of each OS thread's last failed call. A call from C runs
// on the calling thread for its whole duration, so the thread id names the
// caller, as errno does.
var lastErr struct {
	mu sync.Mutex
	m  map[int]string
}

// maxLastErr bounds the table: threads that fail and exit without asking
// leave their entry behind; past this many, each new entry evicts one
// other (not all of them: the messages of live threads that have not
// read theirs yet stay, but for that one).
const maxLastErr = 4096

// fail records err's message for the calling thread and returns its code.
func fail(err error) int {
	tid := unix.Gettid()
	lastErr.mu.Lock()
	if lastErr.m == nil {
		lastErr.m = map[int]string{}
	}
	if _, ok := lastErr.m[tid]; !ok && len(lastErr.m) >= maxLastErr {
		for k := range lastErr.m {
			delete(lastErr.m, k)
			break
		}
	}
	lastErr.m[tid] = err.Error()
	lastErr.mu.Unlock()
	return codeOf(err)
}

// takeLastErr returns and forgets the calling thread's last message.
func takeLastErr() string {
	tid := unix.Gettid()
	lastErr.mu.Lock()
	defer lastErr.mu.Unlock()
	s := lastErr.m[tid]
	delete(lastErr.m, tid)
	return s
}
