package mem

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A shared region maps again read-only with the writer's bytes, can change
// size no more, and its read-only mapping refuses writes.
func TestMapShared(t *testing.T) {
	b, fd, err := MapShared("test", 1<<16)
	require.NoError(t, err)
	defer func() { _ = Unmap(b); _ = unix.Close(fd) }()
	copy(b[100:], "written by the holder")
	r, err := MapReadOnly(fd, 1<<16)
	require.NoError(t, err)
	defer func() { _ = Unmap(r) }()
	require.Equal(t, "written by the holder", string(r[100:121]))
	b[100] = 'W'
	require.Equal(t, byte('W'), r[100], "the reader maps the same pages")

	require.Error(t, unix.Ftruncate(fd, 4096), "a sealed region shrank")
	require.Error(t, unix.Ftruncate(fd, 1<<20), "a sealed region grew")
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE)
	require.Error(t, err, "the seals are sealed")

	_, err = MapReadOnly(fd, 1<<17)
	require.ErrorContains(t, err, "shared region of 65536 bytes")

	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	require.Panics(t, func() { r[0] = 1 }, "a read-only mapping took a write")
}

// A memory file that is not sealed could be truncated under its readers,
// whose reads would then fault: it is refused.
func TestMapReadOnlyRefusesUnsealed(t *testing.T) {
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, 4096))
	_, err = MapReadOnly(fd, 4096)
	require.ErrorContains(t, err, "seals")
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
	require.NoError(t, err)
	r, err := MapReadOnly(fd, 4096)
	require.NoError(t, err, "sealed against shrinking is what a reader needs")
	require.NoError(t, Unmap(r))
}
