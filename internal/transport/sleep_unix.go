//go:build unix

package transport

import (
	"syscall"
	"time"
)

// pause sleeps for about d in the kernel. A Go timer is the wrong tool for
// a poll loop: the runtime wakes a sleeping goroutine from its network
// poller, whose wait rounds to milliseconds, so time.Sleep(1µs) took
// 0.3 ms here, and time.Sleep(100µs) 1.2 ms. nanosleep is late only by the
// thread's timer slack (50 µs by default). It holds the calling thread,
// which the runtime replaces when other goroutines need to run.
func pause(d time.Duration) {
	ts := syscall.NsecToTimespec(d.Nanoseconds())
	for syscall.Nanosleep(&ts, &ts) == syscall.EINTR {
	}
}
