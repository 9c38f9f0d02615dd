package bridge

// prefaulter makes the pool's pages resident ahead of the writes that will
// need them (pool.Prefault), on a goroutine of its own, so that neither a
// save on the host's thread nor the publisher waits for it: a save into
// memory never touched takes a page fault every 4 KiB, which llama-server
// waits for before its first token. It owns only its goroutine; the pool
// owns what is resident. Started by build, ended by Close before the pool
// is unmapped.
type prefaulter struct {
	wake chan struct{} // an allocation may have moved the pool's high mark
	stop chan struct{}
	done chan struct{}
}

// prefaultLimit bounds how far past the pool's highest allocation its
// pages are made resident (as far as the pool holds, up to an eighth of
// it): memory the process would take anyway as it stores more.
func prefaultLimit(pool int64) int64 { return pool / 8 }

func (b *Bridge) startPrefault() {
	pf := &prefaulter{wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	b.prefault = pf
	limit := prefaultLimit(b.hold.Size())
	go func() {
		defer close(pf.done)
		for {
			b.hold.Prefault(limit)
			select {
			case <-pf.wake:
			case <-pf.stop:
				return
			}
		}
	}()
}

func (pf *prefaulter) kick() {
	select {
	case pf.wake <- struct{}{}:
	default:
	}
}

func (pf *prefaulter) close() error {
	close(pf.stop)
	<-pf.done
	return nil
}

// alloc is holdings.Alloc, which moves the pool's high mark: the
// prefaulter then faults the pages past it in.
func (b *Bridge) alloc(n int64) (int64, error) {
	off, err := b.hold.Alloc(n)
	if err == nil {
		b.prefault.kick()
	}
	return off, err
}
