package reliability

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/embedded"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// Seeds of the prompts the cases use: A is published before the fault, B
// is what the fault hits, C evicts.
const (
	seedA = 101
	seedB = 202
	seedC = 303
)

// fcase is one fault case's world: the shared etcd, a key prefix of its
// own, and its teardown.
type fcase struct {
	t    *testing.T
	etcd *etcdtest.Server
	td   teardown
	note []string
}

func (c *fcase) job() job {
	return newJob("/"+strings.ReplaceAll(c.t.Name(), "/", "_"), c.etcd.Endpoint())
}

func (c *fcase) notef(format string, args ...any) {
	c.note = append(c.note, fmt.Sprintf(format, args...))
}

// owner starts an owner process that quits cleanly at teardown unless the
// case killed it.
func (c *fcase) owner(j job) *proc {
	p := startChild(c.t, "owner", j)
	c.td.add(func() error {
		if !p.done {
			p.quit()
		}
		return nil
	})
	return p
}

func (c *fcase) node(cfg config.Config, edit func(*key.Model)) *node {
	n := openNode(c.t, cfg, 1024, edit)
	c.td.add(n.close)
	return n
}

// ownerWithA starts an owner that publishes prompt A, and a reader whose
// mirror holds it.
func (c *fcase) ownerWithA(j job, rc config.Config) (*proc, *node, []int32) {
	o := c.owner(j)
	require.Equal(c.t, fullBlocks, o.save(seedA, ""), "blocks the owner published")
	r := c.node(rc, nil)
	a := prompt(seedA, promptLen)
	waitMatched(c.t, r.m, key.Scope{}, a, fullBlocks)
	return o, r, a
}

// counted checks that a counter moved by want.
func (c *fcase) counted(what string, before, after, want int64) {
	c.t.Helper()
	assert.Equal(c.t, want, after-before, "%s moved by", what)
	c.notef("%s +%d", what, after-before)
}

// countedRetried is counted for a failure the publisher meets again on
// every retry: at least want.
func (c *fcase) countedRetried(what string, before, after, want int64) {
	c.t.Helper()
	assert.GreaterOrEqual(c.t, after-before, want, "%s moved by", what)
	c.notef("%s +%d (retried)", what, after-before)
}

func (c *fcase) failures(code status.Code, before, after bridge.Stats) {
	c.t.Helper()
	c.counted("LoadFailures", before.LoadFailures, after.LoadFailures, 1)
	c.counted("FailuresByStatus["+code.String()+"]", before.FailuresByStatus[code], after.FailuresByStatus[code], 1)
}

// wantErr checks an error's status and that its message names the cause.
func (c *fcase) wantErr(what string, err error, code status.Code, says string) {
	c.t.Helper()
	require.Equal(c.t, code, status.Of(err), "%s: %v", what, err)
	require.ErrorContains(c.t, err, says, what)
}

// evictAll makes a node's pool take a prompt as large as the pool: every
// block it held before is evicted and its memory rewritten.
func (c *fcase) evictAll(o *node) {
	c.t.Helper()
	_, _, poolBytes := o.b.Resident()
	n := int(poolBytes / int64(o.m.BlockBytes()))
	h := newHost(c.t, n*blockTokens+1)
	tokens := prompt(seedC, n*blockTokens+1)
	cells := kvtest.SeqCells(len(tokens))
	h.Fill(tokens, cells)
	before := o.b.Stats().Evictions
	res, err := saveLayers(o.m, h, key.Scope{}, tokens, cells, layers)
	require.NoError(c.t, err, "owner's evicting save")
	require.Equal(c.t, n, res.Published, "owner's evicting save: %+v", res)
	c.counted("owner Evictions", before, o.b.Stats().Evictions, fullBlocks)
}

type faultCase struct {
	name     string
	how      string
	want     status.Code
	restored int
	run      func(c *fcase) outcome
}

var faultCases = []faultCase{
	{"peer killed mid-transfer", "owner SIGKILLed while the reader's engine is stalled (FaultStallAfter)", status.Transfer, 0, peerKilled},
	{"torn block", "one byte flipped in flight (FaultCorrupt, 1 worker)", status.Corrupt, 0, tornBlock},
	{"checksum mismatch", "owner's copy of block 3 rots after publish", status.Corrupt, 48, checksumMismatch},
	{"token mismatch", "owner's block 5 header names other tokens, valid sums (a key collision)", status.Corrupt, 80, tokenMismatch},
	{"transfer timeout", "FaultDelay 400 ms per slice, transfer_timeout_ms 150", status.Timeout, 0, transferTimeout},
	{"transfer status FAILED", "FaultFailAfter 0", status.Transfer, 0, transferFailed},
	{"pool full", "a pool of 31 whole blocks, every one pinned by an open load", status.PoolFull, 0, poolFull},
	{"directory full", "etcd 3.7 (embedded) NOSPACE, 1 MiB quota", status.NotFound, 0, directoryFull},
	{"etcd down", "etcd stopped after the mirror filled", status.OK, 128, etcdDown},
	{"etcd slow", "TCP proxy holds bytes 1.5 s, op_timeout_ms 500", status.OK, 128, etcdSlow},
	{"wrong model or version", "reader registers another llama.cpp version / other weights", status.NotFound, 0, wrongModel},
	{"evicted before read", "owner evicts under pressure while the reader holds its entries", status.Corrupt, 0, evictedBeforeRead},
	{"evicted during read", "owner evicts between the payload and the generation recheck", status.Corrupt, 0, evictedDuringRead},
	{"killed during save", "owner SIGKILLed between SaveLayer calls", status.NotFound, 0, killedDuringSave},
}

// TestFaultMatrix injects each fault into a restore across processes and
// checks the caller's status, that the host ends exactly as after a full
// recompute, that nothing leaks, and that the metrics count the fault.
func TestFaultMatrix(t *testing.T) {
	srv := etcdtest.Start(t)
	warmUp(t, srv)
	type row struct {
		fc       faultCase
		got      outcome
		note     string
		passed   bool
		seconds  float64
		errorMsg string
	}
	var rows []row
	for _, fc := range faultCases {
		t.Run(strings.ReplaceAll(fc.name, " ", "_"), func(t *testing.T) {
			start := time.Now()
			base := runtime.NumGoroutine()
			c := &fcase{t: t, etcd: srv}
			t.Cleanup(func() { c.td.run() })
			var got outcome
			// A case that stops with Fatal still gets its row, as FAIL.
			defer func() {
				msg := ""
				if got.Err != nil {
					msg = got.Err.Error()
				}
				rows = append(rows, row{fc, got, strings.Join(c.note, "; "), !t.Failed(), time.Since(start).Seconds(), msg})
			}()
			got = fc.run(c)
			assert.Equal(t, fc.want, got.Code(), "restore: status (%v)", got.Err)
			assert.Equal(t, fc.restored, got.Restored, "restore: tokens restored (%v)", got.Err)
			for _, err := range c.td.run() {
				assert.NoError(t, err)
			}
			settleGoroutines(t, base)
		})
	}
	var b strings.Builder
	fmt.Fprintln(&b, "| fault | injected | status | restored / asked | counted | result |")
	fmt.Fprintln(&b, "|---|---|---|---|---|---|")
	for _, r := range rows {
		result := "FAIL"
		if r.passed {
			result = "ok: no wrong byte, no leak"
		}
		fmt.Fprintf(&b, "| %s | %s | %s (%d) | %d / %d | %s | %s |\n", r.fc.name, r.fc.how, r.got.Code(), int(r.got.Code()), r.got.Restored, r.got.Asked, r.note, result)
	}
	t.Logf("fault matrix:\n%s", b.String())
	for _, r := range rows {
		t.Logf("%-26s %5.1fs  %s", r.fc.name, r.seconds, r.errorMsg)
	}
	report(t, "fault matrix", b.String())
}

// report appends a section to the file MCB_RELIABILITY_REPORT names, for
// scripts/soak/run.sh.
func report(t *testing.T, title, body string) {
	path := os.Getenv("MCB_RELIABILITY_REPORT")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if !assert.NoError(t, err) {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "## %s (%s)\n\n%s\n", title, time.Now().UTC().Format(time.RFC3339), body)
}

// warmUp opens and closes a bridge over etcd once, so that goroutines the
// libraries start once per process (gRPC's, the test client's) are counted
// in every case's baseline.
func warmUp(t *testing.T, srv *etcdtest.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := srv.Client().Get(ctx, "warmup")
	require.NoError(t, err)
	n := openNode(t, newJob("/warmup", srv.Endpoint()).Config, 64, nil)
	require.NoError(t, n.b.Close())
	require.NoError(t, n.eng.Close())
	n.closed = true
}

func peerKilled(c *fcase) outcome {
	j := c.job()
	o, r, a := c.ownerWithA(j, j.Config)
	g := r.geometry()
	// Every block's header and layer 0, and half of layer 1's bytes: no
	// block has all its layers when the owner dies.
	stall := uint64(fullBlocks * (g.LayerOffset(0) + g.LayerSize(0) + g.LayerSize(1)/2))
	before := r.b.Stats()
	from := r.moved()
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, int64(stall)))
	ld, out := r.begin(r.h, key.Scope{}, a)
	require.NoError(c.t, out.Err)
	r.waitMoved(from, stall)
	o.kill()
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, -1))
	out = r.finish(r.h, ld, a, out)
	c.failures(status.Transfer, before, r.b.Stats())
	return out
}

func tornBlock(c *fcase) outcome {
	// One worker moves tasks in submission order, so the flipped byte
	// lands in block 0.
	c.t.Setenv("MOCK_TE_WORKERS", "1")
	j := c.job()
	_, r, a := c.ownerWithA(j, j.Config)
	before := r.b.Stats()
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultCorrupt, 1))
	out := r.restore(r.h, key.Scope{}, a)
	c.wantErr("torn load", out.Err, status.Corrupt, "checksum mismatch")
	c.failures(status.Corrupt, before, r.b.Stats())
	return out
}

func scribbled(c *fcase, block int, mode, says string) outcome {
	j := c.job()
	o, r, a := c.ownerWithA(j, j.Config)
	o.do("scribble", seedA, promptLen, block, mode)
	before := r.b.Stats()
	out := r.restore(r.h, key.Scope{}, a)
	c.wantErr("load of a damaged block", out.Err, status.Corrupt, says)
	c.failures(status.Corrupt, before, r.b.Stats())
	return out
}

func checksumMismatch(c *fcase) outcome {
	return scribbled(c, 3, "payload", "layer 2: checksum mismatch")
}

func tokenMismatch(c *fcase) outcome { return scribbled(c, 5, "tokens", "key collision") }

func transferTimeout(c *fcase) outcome {
	j := c.job()
	rc := j.Config
	rc.TransferTimeoutMS = 150
	_, r, a := c.ownerWithA(j, rc)
	before := r.b.Stats()
	st, err := r.eng.MockStats()
	require.NoError(c.t, err)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultDelay, 400_000))
	out := r.restore(r.h, key.Scope{}, a)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultDelay, -1))
	c.wantErr("slow load", out.Err, status.Timeout, "waiting for transfers")
	// The load parked its batch; once its tasks end, the next operation
	// frees it with its staging (the teardown's pool check).
	r.waitTasksEnded(st, fullBlocks*layers)
	after := r.b.Stats()
	c.failures(status.Timeout, before, after)
	c.counted("ParkedBatches", before.ParkedBatches, after.ParkedBatches, 1)
	return out
}

func transferFailed(c *fcase) outcome {
	j := c.job()
	_, r, a := c.ownerWithA(j, j.Config)
	before := r.b.Stats()
	st, err := r.eng.MockStats()
	require.NoError(c.t, err)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultFailAfter, 0))
	out := r.restore(r.h, key.Scope{}, a)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultFailAfter, -1))
	c.wantErr("failing load", out.Err, status.Transfer, "transfer failed")
	after, err := r.eng.MockStats()
	require.NoError(c.t, err)
	assert.NotEqual(c.t, st.TasksFailed, after.TasksFailed, "the engine failed no task")
	c.failures(status.Transfer, before, r.b.Stats())
	return out
}

func poolFull(c *fcase) outcome {
	j := c.job()
	rc := j.Config
	// Whole blocks to the byte, the fewest that make the 1 MiB a pool
	// needs: a load that lands in place stages only the blocks' headers,
	// which the slack of a pool of another size holds.
	probe := newHost(c.t, 1)
	size := int64((&pool.Geometry{BlockTokens: blockTokens, KRow: probe.KRow, VRow: probe.VRow}).Size())
	rc.PoolBytes = (1<<20 + size - 1) / size * size
	_, r, a := c.ownerWithA(j, rc)
	// The reader fills its pool with its own prompt and holds a load of
	// all of it open: nothing can be evicted for staging.
	_, _, poolBytes := r.b.Resident()
	n := int(poolBytes / int64(r.m.BlockBytes()))
	own := prompt(seedC, n*blockTokens+1)
	res, err := r.save(key.Scope{}, own)
	require.NoError(c.t, err, "reader's own save")
	require.Equal(c.t, n, res.Published, "reader's own save: %+v", res)
	ownLd, ownOut := r.begin(r.h, key.Scope{}, own)
	require.NoError(c.t, ownOut.Err)
	before := r.b.Stats()
	h := newHost(c.t, 1024)
	out := r.restore(h, key.Scope{}, a)
	c.wantErr("load into a pinned-full pool", out.Err, status.PoolFull, "pinned")
	c.failures(status.PoolFull, before, r.b.Stats())
	ownOut = r.finish(r.h, ownLd, own, ownOut)
	require.NoError(c.t, ownOut.Err, "the pinning load")
	require.Equal(c.t, n*blockTokens, ownOut.Restored, "the pinning load: %+v", ownOut)
	c.notef("the pinning load restored its %d local blocks", n)
	return out
}

func directoryFull(c *fcase) outcome {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(c.t, err)
	url := "http://" + l.Addr().String()
	l.Close()
	stop, err := embedded.Start(c.t.TempDir(), url, embedded.Options{QuotaBytes: 1 << 20})
	require.NoError(c.t, err)
	c.td.add(func() error { stop(); return nil })
	j := newJob("/full", url)
	w := c.node(j.Config, nil)
	r := c.node(j.Config, nil)
	a, b := prompt(seedA, promptLen), prompt(seedB, promptLen)
	res, err := w.save(key.Scope{}, a)
	require.NoError(c.t, err, "save before the quota")
	require.Equal(c.t, fullBlocks, res.Published, "save before the quota: %+v", res)
	fillEtcd(c, url)
	before := w.b.Stats()
	res, err = w.save(key.Scope{}, b)
	require.NoError(c.t, err, "a save into a full etcd does not wait for it")
	c.wantErr("publish into a full etcd", res.PublishErr, status.Directory, "NOSPACE")
	c.countedRetried("writer DirectoryErrors", before.DirectoryErrors, w.b.Stats().DirectoryErrors, 1)
	// The refused blocks stay sealed and resident, to be offered again.
	blocks, _, _ := w.b.Resident()
	assert.Equal(c.t, 2*fullBlocks, blocks, "the writer must keep the %d published and %d refused blocks", fullBlocks, fullBlocks)
	waitMatched(c.t, r.m, key.Scope{}, a, fullBlocks)
	pub := r.restore(r.h, key.Scope{}, a)
	require.NoError(c.t, pub.Err, "restore of what was published before NOSPACE")
	require.Equal(c.t, pub.Asked, pub.Restored, "restore of what was published before NOSPACE: %+v", pub)
	c.notef("save: %s (NOSPACE); the prompt published before it restores fully", status.Of(err))
	rb := r.b.Stats()
	out := r.restore(r.h, key.Scope{}, b)
	c.counted("reader Misses", rb.Misses, r.b.Stats().Misses, 1)
	return out
}

// fillEtcd publishes 1 KiB entries under another prefix until etcd raises
// its NOSPACE alarm.
func fillEtcd(c *fcase, url string) {
	d, err := etcd.New(etcd.Config{Endpoints: []string{url}, Prefix: "/junk"})
	require.NoError(c.t, err)
	c.td.add(d.Close)
	segment := strings.Repeat("s", directory.MaxNameLen)
	for i := 0; i < 100; i++ {
		entries := make([]directory.Entry, 100)
		for j := range entries {
			entries[j] = directory.Entry{Key: key.BlockKey{0: byte(i), 1: byte(j), 2: 7}, Loc: directory.Location{Segment: segment, Owner: "junk"}}
		}
		if _, err := d.Publish(context.Background(), entries); err != nil {
			c.wantErr("filling etcd", err, status.Directory, "NOSPACE")
			return
		}
	}
	require.FailNow(c.t, "a 1 MiB quota took 10000 entries of 1 KiB")
}

func etcdDown(c *fcase) outcome {
	srv := etcdtest.Start(c.t)
	c.td.add(func() error { srv.Stop(); return nil })
	j := newJob("/down", srv.Endpoint())
	j.Config.Directory.OpTimeoutMS = 500
	_, r, a := c.ownerWithA(j, j.Config)
	srv.Stop()
	out := r.restore(r.h, key.Scope{}, a)
	before := r.b.Stats()
	res, err := r.save(key.Scope{}, prompt(seedB, promptLen))
	require.NoError(c.t, err, "a save with etcd down does not wait for it")
	c.wantErr("publish with etcd down", res.PublishErr, status.Directory, "unreachable")
	c.countedRetried("DirectoryErrors", before.DirectoryErrors, r.b.Stats().DirectoryErrors, 1)
	c.notef("save: ok, publish: %s (unreachable)", status.Of(res.PublishErr))
	srv.Restart()
	return out
}

func etcdSlow(c *fcase) outcome {
	p := startProxy(c.t, c.etcd.Endpoint())
	c.td.add(p.close)
	j := c.job()
	rc := j.Config
	rc.Directory.Endpoints = []string{p.URL()}
	rc.Directory.OpTimeoutMS = 500
	// The lease outlives the slow spell, so that the spell and not a lost
	// lease is what the reader sees.
	rc.Directory.LeaseTTLS = 30
	_, r, a := c.ownerWithA(j, rc)
	// The reader's lease is granted in the background; granted during the
	// spell instead, the publish would fail for want of a lease, not of
	// an answer.
	require.Eventually(c.t, func() bool { return r.b.Health() == nil }, 10*time.Second, 10*time.Millisecond,
		"the reader holds a lease before the slow spell: %v", r.b.Health())
	p.setDelay(1500 * time.Millisecond)
	out := r.restore(r.h, key.Scope{}, a)
	before := r.b.Stats()
	b := prompt(seedB, promptLen)
	res, err := r.save(key.Scope{}, b)
	require.NoError(c.t, err, "a save through a slow etcd does not wait for it")
	c.wantErr("publish through a slow etcd", res.PublishErr, status.Timeout, "did not answer")
	c.countedRetried("DirectoryErrors", before.DirectoryErrors, r.b.Stats().DirectoryErrors, 1)
	c.notef("save: ok, publish: %s", status.Of(res.PublishErr))
	lateEntries(c, j, r, b, p)
	return out
}

// lateEntries waits out a timed-out publish that may still commit, ends
// the slow spell, and when the publish left entries of prompt b in etcd
// checks that restoring them is refused rather than wrong, and notes what
// they cost.
func lateEntries(c *fcase, j job, r *node, b []int32, p *slowProxy) {
	c.t.Helper()
	cli := c.etcd.Client()
	prefix := j.Config.Directory.Prefix + "/"
	// The spell outlasts the publish: the request reaches etcd 1.5 s after
	// it was sent, the client's cancel 0.5 s later, and etcd commits in
	// milliseconds. The test's own client bypasses the proxy.
	ghosts := 0
	for deadline := time.Now().Add(3 * time.Second); ghosts < fullBlocks && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
		cancel()
		require.NoError(c.t, err)
		ghosts = 0
		for _, kv := range resp.Kvs {
			var e directory.Entry
			if directory.DecodeValue(kv.Value, &e) == nil && e.Loc.Owner == r.b.Owner() {
				ghosts++
			}
		}
	}
	p.setDelay(0)
	if ghosts == 0 {
		return
	}
	// The saver kept the blocks sealed and resident when the publish timed
	// out, so entries that etcd committed late name valid bytes.
	// Lookups already see the saver's own sealed blocks; wait until the
	// directory's late entries reach the mirror too.
	want := fullBlocks + ghosts // prompt a, then the late entries of b
	for deadline := time.Now().Add(10 * time.Second); r.m.Mirrored() < want; {
		if time.Now().After(deadline) {
			require.FailNowf(c.t, "timed out", "the late entries never reached the mirror: %d of %d", r.m.Mirrored(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	out := r.restore(r.h, key.Scope{}, b)
	assert.NoError(c.t, out.Err, "restore through late entries")
	assert.Equal(c.t, out.Asked, out.Restored, "restore through late entries: %+v", out)
	res, err := r.save(key.Scope{}, b)
	require.NoError(c.t, err)
	assert.Zero(c.t, res.Written, "blocks a new save after the late commit wrote again")
	c.notef("the timed-out publish committed late: %d entries name the sealed blocks, a restore through them gets %d of %d tokens, a new save writes %d",
		ghosts, out.Restored, out.Asked, res.Written)
}

func wrongModel(c *fcase) outcome {
	j := c.job()
	_, r, a := c.ownerWithA(j, j.Config)
	version := c.node(j.Config, func(p *key.Model) { p.LlamaVersion += "-other" })
	weights := c.node(j.Config, func(p *key.Model) { p.ContentHash[0] ^= 1 })
	right := r.restore(r.h, key.Scope{}, a)
	require.NoError(c.t, right.Err, "the right model")
	require.Equal(c.t, right.Asked, right.Restored, "the right model: %+v", right)
	w := weights.restore(weights.h, key.Scope{}, a)
	assert.Equal(c.t, status.NotFound, w.Code(), "other weights: %+v", w)
	before := version.b.Stats()
	out := version.restore(version.h, key.Scope{}, a)
	c.counted("Misses", before.Misses, version.b.Stats().Misses, 1)
	c.notef("other weights: %s too", w.Code())
	return out
}

// evicting opens an owner in this process, whose pool the test fills, and
// a reader whose mirror holds the owner's prompt A.
func (c *fcase) evicting() (o, r *node, a []int32) {
	j := c.job()
	oc := j.Config
	oc.PoolBytes = 1 << 20
	o = c.node(oc, nil)
	a = prompt(seedA, promptLen)
	res, err := o.save(key.Scope{}, a)
	require.NoError(c.t, err, "owner's save")
	require.Equal(c.t, fullBlocks, res.Published, "owner's save: %+v", res)
	rc := j.Config
	rc.TransferTimeoutMS = 20000
	r = c.node(rc, nil)
	waitMatched(c.t, r.m, key.Scope{}, a, fullBlocks)
	return o, r, a
}

func evictedBeforeRead(c *fcase) outcome {
	o, r, a := c.evicting()
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, 0))
	before := r.b.Stats()
	ld, out := r.begin(r.h, key.Scope{}, a)
	require.NoError(c.t, out.Err)
	c.evictAll(o)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, -1))
	out = r.finish(r.h, ld, a, out)
	c.wantErr("load of evicted blocks", out.Err, status.Corrupt, "evicted or rewritten")
	c.failures(status.Corrupt, before, r.b.Stats())
	return out
}

func evictedDuringRead(c *fcase) outcome {
	o, r, a := c.evicting()
	g := r.geometry()
	// Every layer of every block moves; the generation recheck that End
	// reads then waits for the stall to end.
	payload := fullBlocks * (g.LayerOffset(layers-1) + g.LayerSize(layers-1))
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, int64(payload)))
	before := r.b.Stats()
	ld, out := r.begin(r.h, key.Scope{}, a)
	require.NoError(c.t, out.Err)
	for l := 0; l < layers; l++ {
		ok, err := ld.WaitLayer(l)
		require.NoError(c.t, err, "layer %d", l)
		require.Equal(c.t, out.Asked, ok, "layer %d: tokens good", l)
	}
	var res bridge.LoadResult
	var err error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		res, err = ld.End()
	}()
	c.evictAll(o)
	require.NoError(c.t, r.eng.SetFault(mooncake.FaultStallAfter, -1))
	wg.Wait()
	out.Restored, out.Err = res.OKTokens, err
	r.verify(r.h, a, out.Restored)
	c.wantErr("load of blocks rewritten under it", out.Err, status.Corrupt, "changed while read")
	after := r.b.Stats()
	c.failures(status.Corrupt, before, after)
	c.counted("TornReads", before.TornReads, after.TornReads, 1)
	return out
}

func killedDuringSave(c *fcase) outcome {
	j := c.job()
	o, r, a := c.ownerWithA(j, j.Config)
	b := prompt(seedB, promptLen)
	chainB := key.Chain(key.Root(r.m.Fingerprint(), key.Scope{}), b, blockTokens)
	chainA := key.Chain(key.Root(r.m.Fingerprint(), key.Scope{}), a, blockTokens)
	rec := watch(c, j.Config, r.m.Fingerprint())
	require.Equal(c.t, fullBlocks, o.number(o.do("partial", seedB, promptLen, 2)), "blocks of the save the owner began")
	o.kill()
	// Once the dead owner's lease expires its published blocks go; nothing
	// of it can appear after that.
	deadline := time.Now().Add(20 * time.Second)
	for !rec.gone(chainA[:fullBlocks]) {
		if time.Now().After(deadline) {
			require.FailNow(c.t, "the killed owner's blocks never left the directory")
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.Zero(c.t, rec.seen(chainB), "blocks of the interrupted save that became visible")
	before := r.b.Stats()
	out := r.restore(r.h, key.Scope{}, b)
	c.counted("Misses", before.Misses, r.b.Stats().Misses, 1)
	c.notef("no block of the interrupted save was ever published")
	return out
}

// recorder remembers every key a directory subscription saw come and go.
type recorder struct {
	mu   sync.Mutex
	put  map[key.BlockKey]bool
	left map[key.BlockKey]bool
}

func watch(c *fcase, cfg config.Config, fp key.Fingerprint) *recorder {
	d, err := etcd.New(etcd.Config{Endpoints: cfg.Directory.Endpoints, Prefix: cfg.Directory.Prefix})
	require.NoError(c.t, err)
	c.td.add(d.Close)
	r := &recorder{put: map[key.BlockKey]bool{}, left: map[key.BlockKey]bool{}}
	cancel, err := d.Subscribe(fp, func(ev directory.Event) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if ev.Kind == directory.Put {
			r.put[ev.Entry.Key] = true
		} else {
			r.left[ev.Entry.Key] = true
		}
	})
	require.NoError(c.t, err)
	c.td.add(func() error { cancel(); return nil })
	return r
}

func (r *recorder) seen(keys []key.BlockKey) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, k := range keys {
		if r.put[k] {
			n++
		}
	}
	return n
}

func (r *recorder) gone(keys []key.BlockKey) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, k := range keys {
		if !r.left[k] {
			return false
		}
	}
	return true
}
