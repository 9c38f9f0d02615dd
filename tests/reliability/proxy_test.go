package reliability

import (
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// slowProxy forwards TCP connections to a target and holds every chunk of
// bytes, in both directions, for the delay in force when it arrived: a
// slow network or an overloaded etcd, as the client sees it.
type slowProxy struct {
	ln     net.Listener
	target string
	delay  atomic.Int64 // nanoseconds

	mu     sync.Mutex
	conns  []net.Conn
	closed bool
	wg     sync.WaitGroup
}

func startProxy(t *testing.T, targetURL string) *slowProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &slowProxy{ln: ln, target: strings.TrimPrefix(targetURL, "http://")}
	p.wg.Add(1)
	go p.accept()
	return p
}

// URL is where clients connect instead of the target.
func (p *slowProxy) URL() string { return "http://" + p.ln.Addr().String() }

func (p *slowProxy) setDelay(d time.Duration) { p.delay.Store(int64(d)) }

func (p *slowProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			up.Close()
			return
		}
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

type chunk struct {
	due  time.Time
	data []byte
}

// pipe copies src to dst, each chunk released at its arrival plus the
// delay, in order.
func (p *slowProxy) pipe(src, dst net.Conn) {
	defer p.wg.Done()
	q := make(chan chunk, 1024)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for c := range q {
			time.Sleep(time.Until(c.due))
			if _, err := dst.Write(c.data); err != nil {
				break
			}
		}
		dst.Close()
		for range q {
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			q <- chunk{due: time.Now().Add(time.Duration(p.delay.Load())), data: append([]byte(nil), buf[:n]...)}
		}
		if err != nil {
			close(q)
			return
		}
	}
}

// close stops accepting, drops every connection and waits for the pipes.
func (p *slowProxy) close() error {
	err := p.ln.Close()
	p.mu.Lock()
	p.closed = true
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}
