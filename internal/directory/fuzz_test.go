package directory_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// FuzzDecodeValue feeds arbitrary bytes to DecodeValue: it never panics,
// every failure is a directory status, and whatever it accepts is exactly
// what EncodeValue writes for the decoded entry (one encoding per entry).
func FuzzDecodeValue(f *testing.F) {
	e := entry(modelA, 7, "owner")
	good := directory.EncodeValue(&e)
	f.Add(good)
	f.Add(good[:len(good)-1])
	f.Add(append(bytes.Clone(good), 0))
	f.Add([]byte{})
	f.Add([]byte{2})
	long := directory.Entry{Loc: directory.Location{Segment: strings.Repeat("s", directory.MaxNameLen), Owner: "o"}}
	f.Add(directory.EncodeValue(&long))
	f.Fuzz(func(t *testing.T, b []byte) {
		var got directory.Entry
		err := directory.DecodeValue(b, &got)
		if err != nil {
			require.Equal(t, status.Directory, status.Of(err), "error %v", err)
			return
		}
		require.Equal(t, b, directory.EncodeValue(&got), "decoded as %+v, which encodes otherwise", got)
	})
}

// FuzzEncodeValue checks that every entry with names within MaxNameLen
// survives EncodeValue then DecodeValue.
func FuzzEncodeValue(f *testing.F) {
	f.Add([]byte{1, 2, 3}, uint64(4096), uint64(1<<20), uint64(0xdeadbeef), uint64(3), "node-1:12345", "host-42-abc", "1b2e0f3c-boot", "00000000000000ff:/run/user/1000/mcbridge/pool.sock")
	f.Add([]byte{}, uint64(0), uint64(0), uint64(0), uint64(0), "", "", "", "")
	f.Add(bytes.Repeat([]byte{0xff}, 16), ^uint64(0), ^uint64(0), ^uint64(0), ^uint64(0), strings.Repeat("x", directory.MaxNameLen), "\x00\xff", "h", strings.Repeat("p", directory.MaxNameLen))
	f.Fuzz(func(t *testing.T, parent []byte, addr, length, checksum, generation uint64, segment, owner, host, pool string) {
		if len(segment) > directory.MaxNameLen || len(owner) > directory.MaxNameLen || len(host) > directory.MaxNameLen || len(pool) > directory.MaxNameLen {
			return
		}
		in := directory.Entry{Loc: directory.Location{Segment: segment, Addr: addr, Length: length, Checksum: checksum, Generation: generation, Owner: owner, Host: host, Pool: pool}}
		copy(in.Parent[:], parent)
		// Model and Key live in the etcd key, not the value.
		out := directory.Entry{Model: key.Fingerprint{1}, Key: key.BlockKey{2}}
		require.NoError(t, directory.DecodeValue(directory.EncodeValue(&in), &out))
		in.Model, in.Key = out.Model, out.Key
		require.Equal(t, in, out, "round trip")
	})
}
