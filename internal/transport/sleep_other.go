//go:build !unix

package transport

import "time"

func pause(d time.Duration) { time.Sleep(d) }
