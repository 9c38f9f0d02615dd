package proxy

import (
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// slotFile is the file a slot's restores are loaded into, one a slot for the
// proxy's life. It is mapped shared, so a restore's transfers land in the
// very pages the server reads the file from: no buffer between them and no
// copy into the file. At 8k tokens of the bench model (96 MiB, slot
// directory on this machine's disk) that write took 25-133 ms, and a whole
// restore went from 78-81 to 48 ms, and from 226 to 92 ms for a slot's first
// (the first use of a file maps its pages in).
// Its pages are allocated before they are mapped, so that a full file system
// fails the restore with an error instead of a SIGBUS on the first write.
type slotFile struct {
	mu   sync.Mutex // held by the restore using it, and by close
	name string     // in the slot directory, as the server is given it
	path string
	f    *os.File
	mem  []byte // mapped; at least the file's size
}

func createSlotFile(dir, name string) (*slotFile, error) {
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, err
	}
	return &slotFile{name: name, path: path, f: f}, nil
}

// resize makes the file n bytes long, every page of it allocated, and
// returns it mapped. What it held before is left as it was, up to n.
func (sf *slotFile) resize(n int) ([]byte, error) {
	if err := sf.f.Truncate(int64(n)); err != nil {
		return nil, err
	}
	if err := unix.Fallocate(int(sf.f.Fd()), 0, 0, int64(n)); err != nil {
		return nil, &os.PathError{Op: "fallocate", Path: sf.path, Err: err}
	}
	if n > len(sf.mem) {
		if err := sf.unmap(); err != nil {
			return nil, err
		}
		m, err := unix.Mmap(int(sf.f.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return nil, &os.PathError{Op: "mmap", Path: sf.path, Err: err}
		}
		sf.mem = m
	}
	return sf.mem[:n:n], nil
}

func (sf *slotFile) unmap() error {
	if sf.mem == nil {
		return nil
	}
	err := unix.Munmap(sf.mem)
	sf.mem = nil
	return err
}

// close unmaps, closes and removes the file.
func (sf *slotFile) close() error {
	err := sf.unmap()
	if cerr := sf.f.Close(); err == nil {
		err = cerr
	}
	if rerr := os.Remove(sf.path); err == nil {
		err = rerr
	}
	return err
}
