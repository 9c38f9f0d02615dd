package testenv

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Addr is a TCP socket's address.
type Addr struct {
	IP   net.IP
	Port int
}

func (a Addr) String() string { return net.JoinHostPort(a.IP.String(), strconv.Itoa(a.Port)) }

// TCPSocket is one TCP socket a process holds.
type TCPSocket struct {
	Local, Remote Addr
	Listening     bool
	FD            int // the process's descriptor of it
}

// TCPSockets returns the TCP sockets process pid holds, matched by inode
// between its file descriptors and /proc/PID/net/tcp{,6} (the tables of
// its network namespace).
func TCPSockets(tb testing.TB, pid int) []TCPSocket {
	tb.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	require.NoError(tb, err)
	inodes := map[string]int{}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join(dir, fd.Name()))
		n, nerr := strconv.Atoi(fd.Name())
		if err == nil && nerr == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = n
		}
	}
	var out []TCPSocket
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		require.NoError(tb, err)
		for _, line := range strings.Split(string(b), "\n")[1:] {
			s, inode, err := ParseNetTCP(line)
			if fd, ok := inodes[inode]; err == nil && ok {
				s.FD = fd
				out = append(out, s)
			}
		}
	}
	return out
}

// Listeners returns the addresses process pid listens on for TCP.
func Listeners(tb testing.TB, pid int) []Addr {
	tb.Helper()
	var out []Addr
	for _, s := range TCPSockets(tb, pid) {
		if s.Listening {
			out = append(out, s.Local)
		}
	}
	return out
}

// ParseNetTCP reads one line of /proc/net/tcp or tcp6: the local and
// remote addresses (hex words in host byte order, ports in hex), whether
// the socket is in state LISTEN (0A), and its inode.
func ParseNetTCP(line string) (s TCPSocket, inode string, err error) {
	f := strings.Fields(line)
	if len(f) < 10 {
		return s, "", fmt.Errorf("%d fields", len(f))
	}
	if s.Local, err = parseNetAddr(f[1]); err != nil {
		return s, "", err
	}
	if s.Remote, err = parseNetAddr(f[2]); err != nil {
		return s, "", err
	}
	s.Listening = f[3] == "0A"
	return s, f[9], nil
}

func parseNetAddr(field string) (Addr, error) {
	host, port, ok := strings.Cut(field, ":")
	if !ok || (len(host) != 8 && len(host) != 32) {
		return Addr{}, fmt.Errorf("address %q", field)
	}
	raw, err := hex.DecodeString(host)
	if err != nil {
		return Addr{}, err
	}
	p, err := strconv.ParseUint(port, 16, 16)
	if err != nil {
		return Addr{}, err
	}
	// Each 32-bit word is printed as the kernel holds it: little-endian
	// on the machines this runs on.
	ip := make(net.IP, len(raw))
	for i := 0; i < len(raw); i += 4 {
		binary.BigEndian.PutUint32(ip[i:], binary.LittleEndian.Uint32(raw[i:]))
	}
	return Addr{IP: ip, Port: int(p)}, nil
}
