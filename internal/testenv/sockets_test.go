package testenv

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func FuzzParseNetTCP(f *testing.F) {
	f.Add("   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0")
	f.Add("   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 999 1")
	f.Add("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode")
	f.Add("0: 0100007F: 0 0 0 0 0 0 0 0")
	f.Fuzz(func(t *testing.T, line string) {
		s, _, err := ParseNetTCP(line)
		if err == nil {
			for _, a := range []Addr{s.Local, s.Remote} {
				require.True(t, len(a.IP) == 4 || len(a.IP) == 16, "parsed %q into %v", line, a)
				require.GreaterOrEqual(t, a.Port, 0, "parsed %q into %v", line, a)
				require.LessOrEqual(t, a.Port, 65535, "parsed %q into %v", line, a)
			}
		}
	})
}

func TestParseNetTCP(t *testing.T) {
	for _, tc := range []struct {
		line          string
		local, remote string
		listen        bool
		inode         string
	}{
		{"   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1", "127.0.0.1:8080", "0.0.0.0:0", true, "12345"},
		{"   3: 0200007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 77 1", "127.0.0.2:40000", "127.0.0.1:8080", false, "77"},
		{"   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 0:0 00:0 0 0 0 9 1", "[::1]:22", "[::]:0", true, "9"},
	} {
		s, inode, err := ParseNetTCP(tc.line)
		assert.NoError(t, err, "%q", tc.line)
		assert.Equal(t, tc.local, s.Local.String(), "%q: local", tc.line)
		assert.Equal(t, tc.remote, s.Remote.String(), "%q: remote", tc.line)
		assert.Equal(t, tc.listen, s.Listening, "%q: listening", tc.line)
		assert.Equal(t, tc.inode, inode, "%q: inode", tc.line)
	}
}
