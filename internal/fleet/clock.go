package fleet

import "golang.org/x/sys/unix"

type unixTimespec = unix.Timespec

func clockMonotonic(ts *unix.Timespec) { _ = unix.ClockGettime(unix.CLOCK_MONOTONIC, ts) }
