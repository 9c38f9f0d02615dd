package transport

// SetLink reshapes, for the tests, the link that requests this engine submits go over.
func (l *Loopback) SetLink(k Link) {
	l.mu.Lock()
	l.opts.Link = k
	l.mu.Unlock()
}
