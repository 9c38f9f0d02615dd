package kvevents

// ReplayAddr is, for the tests, where the replay socket listens, "" without one.
func (p *Publisher) ReplayAddr() string {
	if p.replay == nil {
		return ""
	}
	return addr(p.replay)
}
