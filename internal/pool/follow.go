package pool

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/status"
)

// FollowDir has ps follow (Follow) every pool whose socket is in dir, but
// the one at own: those there now and each one bound later, as soon as
// inotify reports it, so that no timing decides whether a holder killed
// right after its first save is mapped first. A socket removed is
// unfollowed; so, checked every check, is one whose holder no longer
// listens (a killed holder cannot unlink its socket). Unfollowed, a
// mapping goes once idle, as any: a dead holder's pages live on no longer
// than that. stop ends both.
func (ps *Peers) FollowDir(dir, own string, check time.Duration) (stop func(), err error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, status.Wrap(status.Unsupported, err, "watching the shared pool directory")
	}
	// A socket's bind creates it before its holder listens; the chmod
	// after listen (Share) is the attribute change that says it does.
	const mask = unix.IN_CREATE | unix.IN_ATTRIB | unix.IN_MOVED_TO | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_ONLYDIR
	if _, err := unix.InotifyAddWatch(fd, dir, mask); err != nil {
		_ = unix.Close(fd)
		return nil, status.Wrap(status.Config, err, "watching the shared pool directory "+dir)
	}
	// Non-blocking, the descriptor goes to the runtime's poller, so that
	// Close wakes the Read below.
	events := os.NewFile(uintptr(fd), "inotify "+dir)
	socket := func(name string) (string, bool) {
		path := filepath.Join(dir, name)
		return path, strings.HasSuffix(name, ".sock") && path != own
	}
	names, _ := os.ReadDir(dir)
	for _, e := range names {
		if path, ok := socket(e.Name()); ok {
			ps.Follow(path)
		}
	}

	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
		for {
			n, err := events.Read(buf)
			if err != nil {
				return
			}
			for _, ev := range parseInotify(buf[:n]) {
				path, ok := socket(ev.name)
				switch {
				case !ok:
				case ev.mask&(unix.IN_DELETE|unix.IN_MOVED_FROM) != 0:
					ps.Unfollow(path)
				default:
					ps.Follow(path)
				}
			}
		}
	}()
	go func() {
		defer wg.Done()
		t := time.NewTicker(check)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				for _, path := range ps.Followed() {
					if !listening(path) {
						ps.Unfollow(path)
					}
				}
			}
		}
	}()
	return func() {
		close(done)
		_ = events.Close()
		wg.Wait()
	}, nil
}

// listening says whether a holder listens on the socket at path: a
// connect is refused once it is gone, and taken into the backlog while it
// lives, stopped or not.
func listening(path string) bool {
	c, err := net.DialTimeout("unix", path, 100*time.Millisecond)
	if err != nil {
		return !errors.Is(err, unix.ECONNREFUSED) && !errors.Is(err, unix.ENOENT)
	}
	_ = c.Close()
	return true
}

type inotifyEvent struct {
	mask uint32
	name string
}

// parseInotify splits what one read of an inotify descriptor returned:
// whole events, each a header (wd, mask, cookie, len, in host order) and
// a NUL-padded name of len bytes.
func parseInotify(b []byte) []inotifyEvent {
	var out []inotifyEvent
	for len(b) >= unix.SizeofInotifyEvent {
		mask, n := binary.NativeEndian.Uint32(b[4:]), binary.NativeEndian.Uint32(b[12:])
		if uint64(n) > uint64(len(b)-unix.SizeofInotifyEvent) {
			break
		}
		name := b[unix.SizeofInotifyEvent : unix.SizeofInotifyEvent+int(n)]
		if i := bytes.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		out = append(out, inotifyEvent{mask: mask, name: string(name)})
		b = b[unix.SizeofInotifyEvent+int(n):]
	}
	return out
}
