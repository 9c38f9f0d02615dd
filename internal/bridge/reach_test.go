package bridge_test

import (
	"log/slog"
	"math/rand"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/bridge/bridgetest"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// unreachableDirectory is a memory directory whose health the test sets,
// as an etcd directory's goes when etcd stops answering.
type unreachableDirectory struct {
	*directory.Memory
	down atomic.Bool
}

func (d *unreachableDirectory) Healthy() error {
	if d.down.Load() {
		return status.Errorf(status.Directory, "etcd at http://127.0.0.1:2379 unreachable")
	}
	return nil
}

func (d *unreachableDirectory) Errors() directory.ErrorCounts { return directory.ErrorCounts{} }

// A bridge whose directory goes out of reach says so in its log and in
// Health (mcbridge_up) the first lookup after, once, and that it is back
// when it is.
func TestUnreachableSwarmIsLoggedAndCleared(t *testing.T) {
	cfg := bridgetest.Config(t)
	dir := &unreachableDirectory{Memory: directory.OpenMemory(cfg.Directory.Name)}
	defer dir.Close()
	var clock atomic.Int64
	clock.Store(time.Now().UnixNano())
	var log testenv.LockedBuffer
	b, err := bridge.Open(bridgetest.WithOwner(cfg, "a"), bridge.Deps{Directory: dir, Log: slog.New(slog.NewTextHandler(&log, nil)),
		Now: func() time.Time { return time.Unix(0, clock.Load()) }})
	require.NoError(t, err)
	defer b.Close()
	m := bridgetest.Register(t, b, kvtest.New(t, 2, 32, 16, 16, false), 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(3)), 9)
	lookup := func() {
		_, err := m.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
	}

	dir.down.Store(true)
	lookup()
	assert.Zero(t, strings.Count(log.String(), "swarm unreachable"), "within the first dial's grace the directory is still connecting")
	clock.Add(int64(etcd.DefaultDialTimeout))
	lookup()
	lookup()
	require.Error(t, b.Health(), "mcbridge_up says it")
	assert.Equal(t, 1, strings.Count(log.String(), "msg=\"mcbridge: swarm unreachable: restoring only what this process holds\""), "%s", log.String())

	dir.down.Store(false)
	lookup()
	require.NoError(t, b.Health())
	assert.Equal(t, 1, strings.Count(log.String(), "mcbridge: swarm reachable again"), "%s", log.String())
	assert.Equal(t, 1, strings.Count(log.String(), "swarm unreachable"), "one outage, one line")
}
