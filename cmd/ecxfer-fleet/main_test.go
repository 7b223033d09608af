package main

import (
	"strings"
	"testing"
)

// Bad command lines are refused with status 2 before anything runs:
// values the tool would otherwise replace by defaults, or pass on to
// fail later, and arguments it would ignore.
func TestBadCommandLines(t *testing.T) {
	for _, args := range []string{
		"",
		"nonsense",
		"peers extra",
		"peers --bogus",
		"peers --agents 0",
		"peers --procs -1",
		"peers --block 0",
		"peers --blocks 0",
		"peers --agents 1",
		"consumers --producer-netns ns1",
		"consumers --per-read 0",
		"consumers --blocks 8 --per-read 64",
		"consumers --consumers 1,x",
		"consumers --consumers 0",
		"consumers --duration -1s",
		"consumers --idle sometimes",
		"tcp-serve",
		"tcp-probe",
		"tcp-probe --connect 127.0.0.1:1 --duration 0",
	} {
		if got := run(strings.Fields(args)); got != 2 {
			t.Errorf("ecxfer-fleet %s: exit status %d, want 2", args, got)
		}
	}
}
