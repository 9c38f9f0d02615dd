package e2e

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// A block that rots in a store node's pool is dropped, not offered again:
// the first server to read it finds it bad, recomputes (answering as
// stock) and reports it; the store re-checks its copy, drops and
// unpublishes it; the next server restores the prefix (the dropped
// blocks from the first server's recomputation) without one failed restore.
func TestBadBlockDropped(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	etcd := etcdtest.Start(t)
	cfg := fmt.Sprintf(`{"block_tokens": 64, "directory": {"kind": "etcd", "endpoints": [%q], "lease_ttl_s": 3}, "transport": {"kind": "mooncake", "lib": %q}}`,
		etcd.Endpoint(), mockTE)
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), serverArgs(model, "on", false))

	store := testenv.StartStore(t, "store", cfg, "--pool-bytes", fmt.Sprint(256<<20))
	x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
	x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	waitStore(t, store, "the prefix copied", func(s storeState) bool { return s.Stats.Replicated >= shared/block })
	x.Stop()
	waitStore(t, store, "the prefix published as the store's", func(s storeState) bool { return s.Stats.TakenOver >= shared/block })

	// Bytes rot in the store's pool: the fourth block's header (and the
	// eighth's, which holds the same tokens: the prompt repeats every 256).
	n := corruptPoolBlock(t, store.Pid(), prefix[3*block:4*block])
	require.Positive(t, n, "the block is in the store's pool")

	y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
	waitMirrored(t, y.URL, shared/block)
	first := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 0, NPredict: nPredict})
	assert.Less(t, first.MCB.RestoredN, 4*block, "nothing from the bad block on is restored: %+v", first.MCB)
	assertStock(t, ref.URL, promptB, first, "the first reader computes past the bad block and answers as stock")
	assert.Positive(t, testenv.Metrics(t, y.URL+"/metrics")["mcbridge_bad_blocks_reported_total"], "the reader reports the bad block")
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, store.URL+"/metrics")[`mcbridge_bad_block_checks_total{outcome="dropped"}`] >= 1
	}, "the store re-checks its copy, finds it bad and drops it")
	// y's save raced the drop: when it came first, the directory still
	// named the bad copies and y saved none of the blocks it recomputed.
	// Its next computation of the prefix, after the drop, publishes them.
	again := y.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict})
	assertStock(t, ref.URL, promptB, again, "y again, after the drop, answers as stock")
	waitMirrored(t, y.URL, shared/block)

	z := testenv.StartLlama(t, "z", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
	waitMirrored(t, z.URL, shared/block)
	got := z.Complete(t, testenv.Request{Prompt: promptC, Slot: 0, NPredict: nPredict})
	assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN},
		"the next server restores the prefix, the dropped block from y's recompute: %+v", got.Timings)
	assertStock(t, ref.URL, promptC, got, "and answers as stock")
	t.Logf("%d pool blocks corrupted; y restored %d tokens (%s), z %d", n, first.MCB.RestoredN, first.MCB.Error, got.MCB.RestoredN)
	assert.Zero(t, testenv.Metrics(t, z.URL+"/metrics")["mcbridge_load_failures_total"], "no failed restore: the bad block is not offered again")
}

// corruptPoolBlock flips a token byte in every pool block of the process
// whose header names these tokens, through /proc/PID/mem (root), as a bit
// flip in RAM would; it returns how many it changed. A pool block is
// recognised by its magic and its block size ahead of the tokens, so the
// Go heap's copies of the tokens are left alone.
func corruptPoolBlock(t *testing.T, pid int, tokens []int32) int {
	t.Helper()
	var want bytes.Buffer
	require.NoError(t, binary.Write(&want, binary.LittleEndian, tokens))
	const fixedHeader = 128 // pool format 2: tokens follow the fixed header
	maps, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	require.NoError(t, err)
	defer maps.Close()
	mem, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", pid), os.O_RDWR, 0)
	require.NoError(t, err)
	defer mem.Close()
	n := 0
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 5 || f[1] != "rw-p" || len(f) > 5 {
			continue // the pool is private, anonymous and writable
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		require.NoError(t, err1)
		require.NoError(t, err2)
		buf := make([]byte, end-start)
		if _, err := mem.ReadAt(buf, int64(start)); err != nil {
			continue // a guard region
		}
		for off := 0; ; {
			i := bytes.Index(buf[off:], want.Bytes())
			if i < 0 {
				break
			}
			at := off + i
			off = at + 1
			h := at - fixedHeader
			if h < 0 || string(buf[h:h+4]) != "MCBK" || binary.LittleEndian.Uint32(buf[h+72:]) != uint32(len(tokens)) {
				continue
			}
			flip := []byte{buf[at+4*(len(tokens)/2)] ^ 1}
			_, err := mem.WriteAt(flip, int64(start)+int64(at+4*(len(tokens)/2)))
			require.NoError(t, err)
			n++
		}
	}
	require.NoError(t, sc.Err())
	return n
}
