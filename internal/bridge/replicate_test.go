package bridge

import (
	"math/rand"
	"testing"
	"time"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/transport"
)

// waitFor polls cond: replication runs in its own goroutine.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestStoreOutlivesOwner(t *testing.T) {
	cfg := testConfig(t)
	store := openBridge(t, cfg, "store")
	if err := store.Replicate(); err != nil {
		t.Fatal(err)
	}
	a, err := Open(withOwner(cfg, "a"), Deps{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	src := newHost(t, 3, 64, 32, 48, true)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(11)), 20)
	src.Fill(tokens, kvtest.SeqCells(20))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(20))
	waitFor(t, "the store to copy 5 blocks", func() bool { return store.Stats().Replicated == 5 })

	// The owner exits: it unpublishes, and the store's copies take over.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the store to publish its copies", func() bool { return store.Stats().TakenOver == 5 })

	c := openBridge(t, cfg, "c")
	dst := newHost(t, 3, 64, 32, 48, true)
	mc := register(t, c, dst, 4)
	dst.Scribble()
	res, err := loadAll(t, mc, dst, key.Scope{}, tokens[:20], kvtest.SeqCells(20))
	if err != nil || res.OKTokens != 20 {
		t.Fatalf("restore from the store: %+v, %v", res, err)
	}
	if err := dst.Check(tokens, kvtest.SeqCells(20), 20); err != nil {
		t.Fatal(err)
	}
}

func TestStoreRefusesCorruptCopies(t *testing.T) {
	cfg := testConfig(t)
	a := openBridge(t, cfg, "a")
	a.tr.(*transport.Loopback).SetFault(transport.Fault{Kind: transport.Corrupt})
	store := openBridge(t, cfg, "store")
	src := newHost(t, 2, 32, 16, 16, false)
	ma := register(t, a, src, 4)
	tokens := kvtest.Tokens(rand.New(rand.NewSource(12)), 8)
	src.Fill(tokens, kvtest.SeqCells(8))
	saveAll(t, ma, src, key.Scope{}, tokens, kvtest.SeqCells(8))
	if err := store.Replicate(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "two failed copies", func() bool { return store.Stats().ReplicationFails == 2 })
	if n, _, _ := store.Resident(); n != 0 {
		t.Fatalf("the store kept %d corrupt copies", n)
	}
	if used := store.pool.Used(); used != 0 {
		t.Fatalf("failed copies leaked %d pool bytes", used)
	}
}

func withOwner(c config.Config, owner string) config.Config {
	c.Owner = owner
	return c
}
