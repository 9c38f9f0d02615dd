package bridge_test

import (
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/mem"
)

// A save leaves the pages after what it wrote resident for the next one,
// in the background: the next save does not fault them in on the host's
// thread.
func TestSavePrefaultsThePool(t *testing.T) {
	cfg := bridgetest.Config(t)
	b := bridgetest.Open(t, cfg, "a")
	pool := b.PoolMemory()
	resident := func() int {
		n, err := mem.ResidentPages(pool)
		require.NoError(t, err)
		return n
	}
	require.Zero(t, resident(), "nothing stored, nothing prefaulted")
	h := kvtest.New(t, 2, 256, 512, 512, false)
	m := bridgetest.Register(t, b, h, 64)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(1)), 256)
	h.Fill(tokens, kvtest.SeqCells(256))
	res := bridgetest.SaveAll(t, m, h, key.Scope{}, tokens, kvtest.SeqCells(256))
	require.Equal(t, 4, res.Written, "%+v", res)
	// The blocks' pages, then as many again past them.
	want := 2 * int(b.PoolUsed()/int64(unix.Getpagesize()))
	require.Eventually(t, func() bool { return resident() >= want },
		10*time.Second, 10*time.Millisecond, "as many pages past the saved blocks as they took")
	require.Less(t, resident(), len(pool)/unix.Getpagesize(), "not the whole pool")
}
