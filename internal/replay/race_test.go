//go:build race

package replay

// raceEnabled: the race detector slows the replay about fifteen-fold.
const raceEnabled = true
