//go:build race

package ecxfer

// raceEnabled: the race detector's instrumentation allocates, so exact
// allocation counts are checked in a build without it (make test runs one).
const raceEnabled = true
