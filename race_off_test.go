//go:build !race

package ecxfer

const raceEnabled = false
