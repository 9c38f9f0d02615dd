package reliability

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/mem"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// runOwner is a process that computes and saves prompts when told, and
// holds their blocks in its pool until it quits or is killed.
func runOwner(j job) int {
	tb := childTB{}
	b, err := bridge.Open(j.Config, bridge.Deps{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "open:", err)
		return 1
	}
	h := newHost(tb, j.Cells)
	m, err := b.RegisterModel(spec(h, nil))
	if err != nil {
		fmt.Fprintln(os.Stderr, "register:", err)
		return 1
	}
	var open []*bridge.Save // saves a test kills the process in
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		arg := func(i int) int64 {
			n, err := strconv.ParseInt(f[i], 10, 64)
			if err != nil {
				tb.Fatal("owner: bad argument", f[i])
			}
			return n
		}
		switch f[0] {
		case "save": // save SEED N SALT
			tokens := prompt(arg(1), int(arg(2)))
			cells := kvtest.SeqCells(len(tokens))
			h.Fill(tokens, cells)
			res, err := saveLayers(m, h, scope(f[3]), tokens, cells, layers)
			if err != nil {
				tb.Fatal("owner: save:", err)
			}
			fmt.Println("save", res.Published)
		case "partial": // partial SEED N LAYERS: begin a save, stop after LAYERS layers
			tokens := prompt(arg(1), int(arg(2)))
			cells := kvtest.SeqCells(len(tokens))
			h.Fill(tokens, cells)
			sv, err := m.SaveBegin(key.Scope{}, h.Layout(), tokens, cells)
			if err != nil {
				tb.Fatal("owner: save begin:", err)
			}
			for l := 0; l < int(arg(3)); l++ {
				if err := sv.SaveLayer(l); err != nil {
					tb.Fatal("owner: save layer:", err)
				}
			}
			open = append(open, sv)
			fmt.Println("partial", sv.Blocks())
		case "scribble": // scribble SEED N BLOCK payload|tokens
			tokens := prompt(arg(1), int(arg(2)))
			if err := scribble(j.Config, b.Owner(), m, tokens, int(arg(3)), f[4]); err != nil {
				tb.Fatal("owner: scribble:", err)
			}
			fmt.Println("scribble", f[3])
		case "replicate": // become a store node: copy every other owner's blocks
			node, err := storenode.New(b, storenode.Config{})
			if err == nil {
				err = node.Replicate()
			}
			if err != nil {
				tb.Fatal("owner: replicate:", err)
			}
			fmt.Println("replicate")
		case "stats": // mapped pools, blocks copied, copies published
			st := b.Stats()
			fmt.Println("stats", st.SharedPoolsMapped, st.Replicated, st.TakenOver)
		case "quit":
			if err := b.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "close:", err)
				return 1
			}
			fmt.Println("quit")
			return 0
		default:
			tb.Fatal("owner: unknown command", f[0])
		}
	}
	fmt.Fprintln(os.Stderr, "owner: stdin closed with", len(open), "saves open")
	return 1
}

// saved is a save and what the bridge's publisher made of it.
type saved struct {
	bridge.SaveResult
	Published int
	Deduped   int // found published by another process first
	// PublishErr is why the publisher published fewer blocks than the save
	// queued: the directory's refusal, as the bridge's health reports it.
	PublishErr error
}

// saveLayers saves tokens, copying the first n layers; n below the
// model's layer count ends the save unfinished. Once the save ends it
// waits for the publisher (awaitPublish).
func saveLayers(m *bridge.Model, h *kvtest.Host, sc key.Scope, tokens []int32, cells []uint32, n int) (saved, error) {
	before := m.Bridge().Stats()
	sv, err := m.SaveBegin(sc, h.Layout(), tokens, cells)
	if err != nil {
		return saved{}, err
	}
	for l := 0; l < n; l++ {
		if err := sv.SaveLayer(l); err != nil {
			_, _ = sv.End()
			return saved{}, err
		}
	}
	res, err := sv.End()
	if err != nil {
		return saved{SaveResult: res}, err
	}
	return awaitPublish(m.Bridge(), before, res), nil
}

// awaitPublish waits for the publisher's outcome of a save that ended
// with res, before being b's counters when the save began: the directory
// has the blocks, or refused them, when it returns. Each queued block is
// published, found published by another process first (deduplicated), or
// withdrawn by an eviction before its turn; only the first counts as
// published, so the wait ends when every block is counted either way or
// the publisher has nothing left, not when Published reaches Queued.
func awaitPublish(b *bridge.Bridge, before bridge.Stats, res bridge.SaveResult) saved {
	out := saved{SaveResult: res}
	if res.Queued == 0 {
		return out
	}
	// A refused publish is retried until the bridge closes: wait for the
	// first outcome, not for success.
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		// The publisher counts a batch before it goes idle: probed idle
		// first, the counters read next hold every outcome.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Millisecond)
		idle := b.Flush(ctx) == nil
		cancel()
		st := b.Stats()
		out.Published = int(st.SavedBlocks - before.SavedBlocks)
		out.Deduped = int(st.DedupedBlocks - before.DedupedBlocks)
		if idle || out.Published+out.Deduped >= res.Queued {
			return out
		}
		if st.DirectoryErrors > before.DirectoryErrors {
			out.PublishErr = b.Health()
			return out
		}
	}
	out.PublishErr = fmt.Errorf("the publisher took none of %d blocks in 20s", res.Queued)
	return out
}

// scribble damages this process's copy of block i of tokens, as memory
// that rots under a published entry would: "payload" flips a byte of layer
// 2; "tokens" rewrites the header with other tokens and a valid header sum,
// which is what a 128-bit key collision would look like to a reader.
func scribble(cfg config.Config, owner string, m *bridge.Model, tokens []int32, i int, mode string) error {
	chain := key.Chain(key.Root(m.Fingerprint(), key.Scope{}), tokens, m.BlockTokens())
	e, err := findEntry(cfg, m.Fingerprint(), chain[i])
	if err != nil {
		return err
	}
	if e.Loc.Owner != owner {
		return fmt.Errorf("block %d is held by %s, not by this process", i, e.Loc.Owner)
	}
	block := mem.Bytes(uintptr(e.Loc.Addr), int(e.Loc.Length))
	g, err := pool.ParseGeometry(block)
	if err != nil {
		return err
	}
	switch mode {
	case "payload":
		block[g.LayerOffset(2)+17] ^= 0x5a
	case "tokens":
		h, err := pool.DecodeHeader(block, &g)
		if err != nil {
			return err
		}
		h.Tokens[3]++
		return pool.EncodeHeader(block, &g, &h)
	default:
		return fmt.Errorf("scribble mode %q", mode)
	}
	return nil
}

// findEntry reads one block's entry from the etcd directory cfg names.
func findEntry(cfg config.Config, fp key.Fingerprint, k key.BlockKey) (directory.Entry, error) {
	d, err := etcd.New(etcd.Config{Endpoints: cfg.Directory.Endpoints, Prefix: cfg.Directory.Prefix})
	if err != nil {
		return directory.Entry{}, err
	}
	defer d.Close()
	found := make(chan directory.Entry, 1)
	cancel, err := d.Subscribe(fp, func(ev directory.Event) {
		if ev.Kind == directory.Put && ev.Entry.Key == k {
			select {
			case found <- ev.Entry:
			default:
			}
		}
	})
	if err != nil {
		return directory.Entry{}, err
	}
	defer cancel()
	select {
	case e := <-found:
		return e, nil
	case <-time.After(20 * time.Second):
		return directory.Entry{}, fmt.Errorf("block %s never appeared in the directory", k)
	}
}
