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
// leave their entry behind; past this many the table starts over.
const maxLastErr = 4096

// fail records err's message for the calling thread and returns its code.
func fail(err error) int {
	tid := unix.Gettid()
	lastErr.mu.Lock()
	if lastErr.m == nil || len(lastErr.m) >= maxLastErr {
		lastErr.m = map[int]string{}
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
