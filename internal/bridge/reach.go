package bridge

import (
	"time"

	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/reach"
)

// reachProbe is how often the bridge checks that its swarm answers, so
// that an outage, and the end of one, is logged while no request comes.
const reachProbe = time.Second

// startReach starts the watch on the swarm (package reach) and its probe.
// The grace is the etcd client's first dial: the directory connects in
// the background, and Health reports it unreachable until it has.
func (b *Bridge) startReach() {
	b.reach = reach.New(b.log, b.now, etcd.DefaultDialTimeout)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(reachProbe)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				b.reach.Probe(b.Health())
			case <-b.closeCh:
				return
			}
		}
	}()
	// Ends before the parts Health reads close.
	b.closers = append(b.closers, func() error { <-done; return nil })
}
