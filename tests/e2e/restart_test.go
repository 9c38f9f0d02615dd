package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/disk"
	"github.com/mcbridge/mcbridge/internal/residency"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// storeState is the part of a store node's /state the tests read.
type storeState struct {
	Blocks int `json:"blocks"`
	Stats  struct {
		Replicated int `json:"Replicated"`
		TakenOver  int `json:"TakenOver"`
		PagedIn    int `json:"PagedIn"`
	} `json:"stats"`
	Disk struct {
		Files       int `json:"Files"`
		Dropped     int `json:"Dropped"`
		Written     int `json:"Written"`
		WriteErrors int `json:"WriteErrors"`
	} `json:"disk"`
}

func (s storeState) String() string { b, _ := json.Marshal(s); return string(b) }

func readState(t *testing.T, store *testenv.Store) storeState {
	t.Helper()
	var st storeState
	require.NoError(t, jsonGet(t, store.URL+"/state", &st))
	return st
}

// diskSwarm is a single-host swarm as a user runs it: a store node with an
// embedded etcd and a disk tier, both in directories that outlive it, and
// the patched servers' configuration pointing at them.
type diskSwarm struct {
	etcdURL, etcdDir, diskDir string
	transport                 string // every process's transport (and shared pool) configuration
	serverCfg                 string // the patched servers' bridge configuration
}

// newDiskSwarm is a swarm whose processes reach each other over the
// (mock) Transfer Engine, as across hosts.
func newDiskSwarm(t *testing.T, extra string) *diskSwarm {
	return newSwarmOver(t, fmt.Sprintf(`"transport": {"kind": "mooncake", "lib": %q}`, mockTE), extra)
}

// newOneHostSwarm is a swarm set up as docs/ollama.md sets up one host:
// the in-process transport and shared pools, no port opened.
func newOneHostSwarm(t *testing.T, extra string) *diskSwarm {
	return newSwarmOver(t, fmt.Sprintf(`"transport": {"kind": "loopback"}, "shared_pool": {"enabled": true, "dir": %q}`, t.TempDir()), extra)
}

func newSwarmOver(t *testing.T, transport, extra string) *diskSwarm {
	dir := t.TempDir()
	s := &diskSwarm{
		etcdURL: "http://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
		etcdDir: filepath.Join(dir, "etcd"), diskDir: filepath.Join(dir, "disk"),
		transport: transport,
	}
	// A short lease: a process killed without unpublishing leaves entries
	// that name it until the lease runs out; the store takes over then.
	s.serverCfg = fmt.Sprintf(`{"block_tokens": 64, "directory": {"kind": "etcd", "endpoints": [%q], "lease_ttl_s": 3}, %s%s}`,
		s.etcdURL, transport, extra)
	return s
}

// startStore starts (or restarts) the store node.
func (s *diskSwarm) startStore(t *testing.T, name string) *testenv.Store {
	cfg := fmt.Sprintf(`{"block_tokens": 64, "directory": {"lease_ttl_s": 3}, %s}`, s.transport)
	return testenv.StartStore(t, name, cfg, "--embed-etcd", "--etcd-dir", s.etcdDir, "--etcd-client-url", s.etcdURL,
		"--disk-dir", s.diskDir, "--disk-bytes", fmt.Sprint(1<<30), "--pool-bytes", fmt.Sprint(256<<20))
}

// waitStore waits until the store node's state satisfies cond.
func waitStore(t *testing.T, store *testenv.Store, what string, cond func(storeState) bool) {
	t.Helper()
	var last storeState
	testenv.Eventually(t, defaultWait, func() bool {
		last = readState(t, store)
		return cond(last)
	}, "the store never reached: %s (last state %s)", what, &last)
}

// The whole swarm restarts and is still warm: patched servers and a store
// node with a disk tier share a prefix; every process stops (SIGTERM; in
// another run SIGKILL: nothing unpublished, nothing flushed; in a third
// SIGKILL and one of the prefix's block files cut in half; in a fourth
// SIGKILL after the store's disk filled up); the store node starts again
// on its directories, then a new patched server, whose first request
// restores what the store read back from its disk (the prefix, or its
// blocks before the torn file or up to where the disk filled) and answers
// as stock. Restored token counts, not times, show that only the remainder
// was computed.
func TestSwarmRestart(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), serverArgs(model, "on", false))
	for _, stop := range []string{"SIGTERM", "SIGKILL", "SIGKILL-torn", "SIGKILL-disk-full"} {
		t.Run(stop, func(t *testing.T) {
			sw := newDiskSwarm(t, "")
			if stop == "SIGKILL-disk-full" {
				// A filesystem that holds a few of the tiny model's
				// 20 KiB block files, not the prefix's nine.
				sw.diskDir = testenv.TmpFS(t, "100k")
			}
			store := sw.startStore(t, "store")
			x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", sw.serverCfg))
			require.Equal(t, "on", x.BridgeState())
			y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", sw.serverCfg))
			x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
			waitMirrored(t, y.URL, shared/block)
			got := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
			require.Equal(t, shared, got.MCB.RestoredN, "y restores what x computed: %+v", got.MCB)
			// A kill loses what the store has not written yet: wait for
			// its disk to hold the prefix (and the rest it copied).
			waitStore(t, store, "every block copied and on its disk", func(s storeState) bool {
				if stop == "SIGKILL-disk-full" {
					return s.Stats.Replicated >= shared/block && s.Disk.Written+s.Disk.WriteErrors >= s.Stats.Replicated
				}
				return s.Stats.Replicated >= shared/block && s.Disk.Files >= s.Stats.Replicated
			})

			if stop == "SIGKILL-disk-full" {
				// The store refused what did not fit and serves it from
				// DRAM until the kill.
				st := readState(t, store)
				require.Positive(t, st.Disk.WriteErrors, "the filesystem filled: %s", &st)
			}
			for _, p := range []*testenv.Server{x.Server, y.Server, store.Server} {
				if stop == "SIGTERM" {
					p.Stop()
				} else {
					p.Kill()
				}
			}
			restored := shared
			if stop == "SIGKILL-torn" {
				// The host went down mid-write: the prefix's third block
				// file is cut in half. It is dropped; the two before it
				// restore, the rest is computed.
				tearFile(t, sw.diskDir, 2)
				restored = 2 * block
			}
			if stop == "SIGKILL-disk-full" {
				restored = block * chainOnDisk(t, sw.diskDir)
				require.Positive(t, restored, "some of the prefix fit")
				require.Less(t, restored, shared, "not all of it")
				t.Logf("%d of the prefix's %d blocks fit on the disk", restored/block, shared/block)
			}

			again := sw.startStore(t, "store-again")
			st := readState(t, again)
			switch {
			case stop == "SIGKILL-disk-full":
				require.Zero(t, st.Disk.Dropped, "what was written is whole: %s", &st)
			case restored == shared:
				require.GreaterOrEqual(t, st.Disk.Files, shared/block, "the disk tier's files survive: %s", &st)
				require.Zero(t, st.Disk.Dropped, "no file was torn: %s", &st)
			default:
				require.Positive(t, st.Disk.Dropped, "the torn file is dropped and counted: %s", &st)
			}
			// Read back at start, the blocks are published as the store's
			// own once the entries of the processes that died are gone
			// (at once after SIGTERM, when their leases run out after
			// SIGKILL).
			waitStore(t, again, "the prefix published from the disk", func(s storeState) bool {
				return s.Stats.PagedIn >= restored/block && s.Stats.TakenOver >= s.Stats.PagedIn
			})
			z := testenv.StartLlama(t, "z", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", sw.serverCfg))
			waitMirrored(t, z.URL, restored/block)
			first := z.Complete(t, testenv.Request{Prompt: promptC, Slot: 0, NPredict: nPredict})
			assert.Equal(t, []any{"restore", restored, len(promptC) - restored}, []any{first.MCB.Decision, first.MCB.RestoredN, first.Timings.PromptN},
				"the first request after the restart restores the prefix and computes only the rest: %+v", first.Timings)
			assertStock(t, ref.URL, promptC, first, "the restored server answers as stock")
		})
	}
}

// tearFile truncates to half the file of the block at the given depth
// from the chain's first, in a disk tier no store has open: the shared
// prefix's, the one chain every prompt here starts with.
func tearFile(t *testing.T, dir string, depth int) {
	t.Helper()
	tier, byDepth := prefixOnDisk(t, dir)
	require.Len(t, byDepth[depth], 1, "one block at depth %d of the shared prefix", depth)
	k := byDepth[depth][0].Key.String()
	path := filepath.Join(tier.Dir(), k[:2], k)
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.NoError(t, os.Truncate(path, st.Size()/2))
}

// chainOnDisk is how many of the shared prefix's blocks, from its first,
// a disk tier no store has open holds.
func chainOnDisk(t *testing.T, dir string) int {
	t.Helper()
	_, byDepth := prefixOnDisk(t, dir)
	n := 0
	for n < shared/block && len(byDepth[n]) == 1 {
		n++
	}
	return n
}

// prefixOnDisk opens a disk tier no store has open and returns its
// blocks by depth from the shallowest.
func prefixOnDisk(t *testing.T, dir string) (*disk.Tier, map[int][]disk.Meta) {
	t.Helper()
	tier, err := disk.Open(disk.Config{Dir: dir, Bytes: 1 << 30, Policy: residency.LRU})
	require.NoError(t, err)
	metas := tier.Blocks()
	require.NotEmpty(t, metas)
	first := metas[0].Depth
	for _, m := range metas {
		first = min(first, m.Depth)
	}
	byDepth := map[int][]disk.Meta{}
	for _, m := range metas {
		byDepth[int(m.Depth-first)] = append(byDepth[int(m.Depth-first)], m)
	}
	return tier, byDepth
}

// A patched server killed the moment its answer arrives, as Ollama kills
// a runner when keep_alive is 0, loses none of the blocks that answer's
// prompt saved. The answer goes out only once the directory names them
// (llama-patches/0008), and the store node, which mapped the server's
// shared pool when the server started, copies them from the mapping and
// serves them once the killed server's lease is gone. One token is
// generated: the answer follows the prompt's save at once, the closest a
// kill can come to it.
func TestKilledAtItsAnswer(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	sw := newOneHostSwarm(t, "")
	store := sw.startStore(t, "store")
	args := append(serverArgs(model, "on", false), "--mcb-config", sw.serverCfg)
	x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), args)
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, store.URL+"/metrics")["mcbridge_shared_pools_mapped"] >= 1
	}, "the store never mapped the server's pool")
	got := x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: 1})
	x.Kill()
	saved := got.MCB.SavedBlocks
	require.GreaterOrEqual(t, saved, shared/block, "blocks the answer's prompt saved: %+v", got.MCB)
	waitStore(t, store, "every block of the killed server copied, and served", func(st storeState) bool {
		return st.Stats.Replicated >= saved && st.Stats.TakenOver >= st.Stats.Replicated
	})

	y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), args)
	waitMirrored(t, y.URL, shared/block)
	c := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	require.Equal(t, shared, c.MCB.RestoredN, "y restores what the killed server computed: %+v", c.MCB)
}
