// Package replay runs a Mooncake request trace through the bridge's real
// code (keys, the mirror of the memory directory, the arbiter, the pool and
// its eviction, the bridge's loads and saves over the Loopback
// transport) and reports the prefix hit ratio and a modelled time to first
// token for each arbiter policy.
//
// What runs and what is modelled:
//
//   - Each hash id becomes a fixed block of token ids, so requests that
//     share leading ids share a token prefix and nothing else.
//
//   - Servers simulated llama-server processes, each with its own bridge,
//     pool and arbiter, share one memory directory; request i goes to
//     server i mod Servers. A server restores blocks from its own pool
//     in place and from its peers' pools through Loopback reads, which
//     land in the host's cells (or in staging, where those are scattered),
//     with every check a real restore makes.
//
//   - The bytes moved belong to a tiny KV geometry (one layer, a few bytes
//     per token), so that a trace of 60 million tokens replays in seconds.
//     The pool holds as many of these blocks as it would hold blocks of the
//     preset's real KV, so hits and evictions are the real ones.
//
//   - Restored rows are checked against what prefill would have written:
//     a wrong byte stops the replay.
//
//   - Time is modelled, never measured: for each request
//
//     TTFT = restore + prefill(restored, P)
//     restore = local·K/LocalBandwidth + [remote > 0]·(Latency + remote·K/Bandwidth)
//
//     with P the prompt's tokens, local and remote the restored tokens that
//     came from this server's pool and from peers', K the preset's KV bytes
//     per token, and prefill the preset's true cost of computing positions
//     [restored, P). The restore completes before the remainder's prefill
//     starts, as the bridge does on host memory. Queueing is not modelled:
//     requests run one at a time.
//
//   - The decision is the arbiter's, asked with the preset's KV bytes per
//     token (the bridge's own Lookup asks with the tiny geometry's
//     bytes; that answer is ignored). Each server's arbiter starts from
//     its defaults and learns from what each request cost, through
//     ObservePrefill and ObserveTransfer, on the trace's clock. A decision
//     names the link of the prompt's first block, "local" or "fabric",
//     as the bridge names it by segment.
package replay

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mcbridge/mcbridge/internal/arbiter"
	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvhost"
	"github.com/mcbridge/mcbridge/internal/pool"
	"github.com/mcbridge/mcbridge/internal/preset"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Options configures a replay. Zero fields take the defaults noted.
type Options struct {
	// BlockTokens is the tokens of one hash id and of one bridge block (512).
	BlockTokens int
	// Servers is the number of simulated llama-server processes (4).
	Servers int
	// PoolBytes bounds the cache, counted in the preset's real KV bytes and
	// split evenly over the servers; 0 holds every block of the trace.
	PoolBytes int64
	// Preset is the model and machine time is charged for (bench-cpu).
	Preset preset.Preset
	// Bandwidth (bytes per second) and Latency model the link between
	// servers (25 GB/s, 10 µs).
	Bandwidth float64
	Latency   time.Duration
	// Eviction is "lru" or "cost" (lru).
	Eviction string
	// Policies are replayed one after the other, each from an empty cache
	// (all three, cost-model first).
	Policies []arbiter.Policy
	// Requests replays only the first n requests; 0 replays all.
	Requests int
}

func (o Options) withDefaults() Options {
	if o.BlockTokens == 0 {
		o.BlockTokens = 512
	}
	if o.Servers == 0 {
		o.Servers = 4
	}
	if o.Preset.Name == "" {
		o.Preset = preset.BenchCPU
	}
	if o.Bandwidth == 0 {
		o.Bandwidth = 25e9
		if o.Latency == 0 {
			o.Latency = 10 * time.Microsecond
		}
	}
	if o.Eviction == "" {
		o.Eviction = "lru"
	}
	if len(o.Policies) == 0 {
		o.Policies = []arbiter.Policy{arbiter.CostModel, arbiter.AlwaysRestore, arbiter.AlwaysRecompute}
	}
	return o
}

func (o Options) validate() error {
	switch {
	case o.BlockTokens < 1 || o.BlockTokens > pool.MaxBlockTokens:
		return status.Errorf(status.InvalidArg, "block of %d tokens (1..%d)", o.BlockTokens, pool.MaxBlockTokens)
	case o.Servers < 1 || o.Servers > 256:
		return status.Errorf(status.InvalidArg, "%d servers (1..256)", o.Servers)
	case o.PoolBytes < 0:
		return status.Errorf(status.InvalidArg, "negative pool of %d bytes", o.PoolBytes)
	case o.Preset.KVBytesPerToken < 1 || o.Preset.Prefill == nil || !(o.Preset.LocalBandwidth > 0):
		return status.Errorf(status.InvalidArg, "preset %q is incomplete", o.Preset.Name)
	case !(o.Bandwidth > 0) || math.IsInf(o.Bandwidth, 0) || o.Latency < 0:
		return status.Errorf(status.InvalidArg, "link of %g B/s and %v latency", o.Bandwidth, o.Latency)
	case o.Eviction != "lru" && o.Eviction != "cost":
		return status.Errorf(status.InvalidArg, "eviction %q: lru or cost", o.Eviction)
	case o.Requests < 0:
		return status.Errorf(status.InvalidArg, "negative request count %d", o.Requests)
	}
	return nil
}

// Percentiles summarises a distribution of times in milliseconds.
type Percentiles struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
}

// PolicyRun is one policy's replay.
type PolicyRun struct {
	Policy string `json:"policy"`
	// HitTokens are the tokens the cache matched and could restore; the
	// policy then decides how many of them RestoredTokens are.
	HitTokens            int64       `json:"hit_tokens"`
	PrefixHitRatio       float64     `json:"prefix_hit_ratio"`
	RestoredTokens       int64       `json:"restored_tokens"`
	RemoteRestoredTokens int64       `json:"remote_restored_tokens"`
	RecomputedTokens     int64       `json:"recomputed_tokens"`
	Loads                int64       `json:"loads"`
	LoadFailures         int64       `json:"load_failures"`
	SavedBlocks          int64       `json:"saved_blocks"`
	DedupedBlocks        int64       `json:"deduped_blocks"`
	SaveShortfalls       int64       `json:"save_shortfalls"`
	Evictions            int64       `json:"evictions"`
	TTFT                 Percentiles `json:"ttft_ms"`
	WallSeconds          float64     `json:"wall_seconds"`
}

// Result is a whole replay. Its top-level hit and token counts are the
// first policy's; TTFT holds every policy's, keyed arbiter (cost-model),
// restore (always-restore) and recompute (always-recompute).
type Result struct {
	Requests            int                    `json:"requests"`
	InputTokens         int64                  `json:"input_tokens"`
	BlockTokens         int                    `json:"block_tokens"`
	Servers             int                    `json:"servers"`
	Preset              string                 `json:"preset"`
	KVBytesPerToken     int64                  `json:"kv_bytes_per_token"`
	LinkGBps            float64                `json:"link_gbps"`
	LatencyUS           float64                `json:"latency_us"`
	Eviction            string                 `json:"eviction"`
	PoolBytes           int64                  `json:"pool_bytes"`
	PoolBlocks          int64                  `json:"pool_blocks"`
	DistinctBlocks      int                    `json:"distinct_blocks"`
	IdealPrefixHitRatio float64                `json:"ideal_prefix_hit_ratio"`
	PrefixHitRatio      float64                `json:"prefix_hit_ratio"`
	HitTokens           int64                  `json:"hit_tokens"`
	RestoredTokens      int64                  `json:"restored_tokens"`
	RecomputedTokens    int64                  `json:"recomputed_tokens"`
	TTFT                map[string]Percentiles `json:"ttft_ms"`
	Runs                []PolicyRun            `json:"policies"`
}

// TTFTKey is the name a policy's TTFT goes by in Result.TTFT.
func TTFTKey(p arbiter.Policy) string {
	switch p {
	case arbiter.CostModel:
		return "arbiter"
	case arbiter.AlwaysRestore:
		return "restore"
	case arbiter.AlwaysRecompute:
		return "recompute"
	}
	return p.String()
}

// Run replays trace once per policy.
func Run(trace []Request, opt Options) (Result, error) {
	opt = opt.withDefaults()
	if err := opt.validate(); err != nil {
		return Result{}, err
	}
	if opt.Requests > 0 && opt.Requests < len(trace) {
		trace = trace[:opt.Requests]
	}
	if err := Check(trace, opt.BlockTokens); err != nil {
		return Result{}, err
	}
	hit, total := IdealHitTokens(trace, opt.BlockTokens)
	res := Result{
		Requests: len(trace), InputTokens: total, BlockTokens: opt.BlockTokens, Servers: opt.Servers,
		Preset: opt.Preset.Name, KVBytesPerToken: opt.Preset.KVBytesPerToken,
		LinkGBps: opt.Bandwidth / 1e9, LatencyUS: float64(opt.Latency) / float64(time.Microsecond),
		Eviction: opt.Eviction, PoolBytes: opt.PoolBytes, DistinctBlocks: distinctFullBlocks(trace, opt.BlockTokens),
		IdealPrefixHitRatio: ratio(hit, total), TTFT: map[string]Percentiles{},
	}
	for _, p := range opt.Policies {
		run, poolBlocks, err := runPolicy(trace, opt, p)
		if err != nil {
			return res, fmt.Errorf("replay with %s: %w", p, err)
		}
		res.PoolBlocks = poolBlocks
		res.Runs = append(res.Runs, run)
		res.TTFT[TTFTKey(p)] = run.TTFT
	}
	first := res.Runs[0]
	res.PrefixHitRatio, res.HitTokens = first.PrefixHitRatio, first.HitTokens
	res.RestoredTokens, res.RecomputedTokens = first.RestoredTokens, first.RecomputedTokens
	return res, nil
}

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// distinctFullBlocks counts the ids that some request holds as a full block.
func distinctFullBlocks(trace []Request, blockTokens int) int {
	seen := map[int64]struct{}{}
	for _, r := range trace {
		for _, id := range r.HashIDs[:r.InputLength/blockTokens] {
			seen[id] = struct{}{}
		}
	}
	return len(seen)
}

// Tiny geometry: one layer of f16 K and V rows, as narrow as the pool's
// floor allows.
const (
	tinyLayers  = 1
	minRowBytes = 2
)

// replayGeometry picks the tiny rows and each server's pool: blocksPerServer
// blocks, or, unbounded, room for every full block of the trace and the
// staging of the largest restore twice over.
func replayGeometry(trace []Request, opt Options) (row int, blocksPerServer, poolBlocks int64, err error) {
	if opt.PoolBytes == 0 {
		most := 0
		for _, r := range trace {
			most = max(most, len(r.HashIDs))
		}
		blocksPerServer = int64(distinctFullBlocks(trace, opt.BlockTokens) + 2*most + 2)
	} else {
		blockBytes := int64(opt.BlockTokens) * opt.Preset.KVBytesPerToken
		poolBlocks = opt.PoolBytes / blockBytes
		blocksPerServer = poolBlocks / int64(opt.Servers)
		if blocksPerServer < 2 {
			return 0, 0, 0, status.Errorf(status.InvalidArg,
				"a pool of %d bytes holds %d blocks of %d bytes over %d servers: at least 2 per server", opt.PoolBytes, poolBlocks, blockBytes, opt.Servers)
		}
	}
	// Widen the rows until the pool reaches the config's floor: a few
	// large blocks weigh what many small ones do.
	// The estimate from the shortfall can miss by the blocks' alignment.
	row = minRowBytes
	if short := minPoolBytes - blocksPerServer*tinyBlockSize(opt.BlockTokens, row); short > 0 {
		perRow := short / blocksPerServer / int64(2*opt.BlockTokens)
		row += int(perRow) / minRowBytes * minRowBytes
	}
	for blocksPerServer*tinyBlockSize(opt.BlockTokens, row) < minPoolBytes {
		row += minRowBytes
	}
	return row, blocksPerServer, poolBlocks, nil
}

// minPoolBytes is the smallest pool the bridge's config accepts.
const minPoolBytes = 1 << 20

func tinyBlockSize(blockTokens, row int) int64 {
	g := pool.Geometry{BlockTokens: blockTokens, KRow: []int{row}, VRow: []int{row}}
	return int64(g.Size())
}

// replays numbers each replay's directory and engines: their names are
// process-wide.
var replays atomic.Int64

type server struct {
	b   *bridge.Bridge
	m   *bridge.Model
	arb *arbiter.Arbiter
}

// cluster is one policy's replay state.
type cluster struct {
	opt     Options
	servers []*server
	host    *kvhost.Host
	cells   []uint32
	root    key.Hash
	now     time.Time
	run     PolicyRun
	ttft    []float64
	tokens  []int32
	keys    []key.BlockKey

	// holder is the server whose pool holds each published block, as the
	// directory says: the replay watches it like any mirror does.
	mu     sync.Mutex
	holder map[key.BlockKey]int
	owners map[string]int
}

// watch keeps holder in step with the directory.
func (c *cluster) watch(ev directory.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ours := c.owners[ev.Entry.Loc.Owner]
	switch {
	case !ours:
	case ev.Kind == directory.Put:
		c.holder[ev.Entry.Key] = s
	case c.holder[ev.Entry.Key] == s:
		delete(c.holder, ev.Entry.Key)
	}
}

// holderOf is the server that holds block k, or -1.
func (c *cluster) holderOf(k key.BlockKey) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.holder[k]; ok {
		return s
	}
	return -1
}

func runPolicy(trace []Request, opt Options, p arbiter.Policy) (_ PolicyRun, _ int64, err error) {
	start := time.Now()
	row, perServer, poolBlocks, err := replayGeometry(trace, opt)
	if err != nil {
		return PolicyRun{}, 0, err
	}
	most := 0
	for _, r := range trace {
		most = max(most, r.InputLength)
	}
	c := &cluster{opt: opt, cells: kvhost.Positions(most), run: PolicyRun{Policy: p.String()},
		holder: map[key.BlockKey]int{}, owners: map[string]int{}}
	if c.host, err = kvhost.New(tinyLayers, most, row, row); err != nil {
		return PolicyRun{}, 0, err
	}
	defer c.host.Close()
	defer func() {
		// A bridge that cannot close cleanly (a transfer still in flight)
		// is a finding of the replay too.
		if cerr := c.close(); err == nil {
			err = cerr
		}
	}()
	id := replays.Add(1)
	cfg := config.Default()
	cfg.PoolBytes = perServer * tinyBlockSize(opt.BlockTokens, row)
	cfg.BlockTokens = opt.BlockTokens
	cfg.Eviction = opt.Eviction
	cfg.Arbiter.Policy = p.String()
	cfg.Directory.Name = fmt.Sprintf("replay-%d", id)
	spec := c.host.Spec("replay", opt.BlockTokens)
	fp := spec.Params.Fingerprint()
	c.root = key.Root(fp, key.Scope{})
	for s := range opt.Servers {
		c.owners[fmt.Sprintf("replay-%d-server-%d", id, s)] = s
	}
	dir := directory.OpenMemory(cfg.Directory.Name)
	defer dir.Close()
	stop, err := dir.Subscribe(fp, c.watch)
	if err != nil {
		return PolicyRun{}, 0, err
	}
	defer stop()
	for s := range opt.Servers {
		cfg.Owner = fmt.Sprintf("replay-%d-server-%d", id, s)
		b, err := bridge.Open(cfg, bridge.Deps{})
		if err != nil {
			return PolicyRun{}, 0, err
		}
		sv := &server{b: b}
		c.servers = append(c.servers, sv)
		if sv.m, err = b.RegisterModel(spec); err != nil {
			return PolicyRun{}, 0, err
		}
		if sv.arb, err = arbiter.New(arbiter.Config{Policy: p, Now: c.clock}); err != nil {
			return PolicyRun{}, 0, err
		}
	}
	var inputTokens int64
	for i := range trace {
		if err := c.request(i, &trace[i]); err != nil {
			return PolicyRun{}, 0, fmt.Errorf("request %d: %w", i, err)
		}
		inputTokens += int64(trace[i].InputLength)
	}
	for _, sv := range c.servers {
		c.run.Evictions += sv.b.Stats().Evictions
	}
	c.run.PrefixHitRatio = ratio(c.run.HitTokens, inputTokens)
	c.run.TTFT = percentiles(c.ttft)
	c.run.WallSeconds = time.Since(start).Seconds()
	return c.run, poolBlocks, nil
}

func (c *cluster) clock() time.Time { return c.now }

func (c *cluster) close() error {
	var first error
	for _, sv := range c.servers {
		if err := sv.b.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// request replays one request on server i mod Servers.
func (c *cluster) request(i int, r *Request) error {
	opt := &c.opt
	B := opt.BlockTokens
	s := i % opt.Servers
	sv := c.servers[s]
	c.now = time.UnixMilli(r.Timestamp)
	c.tokens = promptTokens(c.tokens, r, B)
	tokens := c.tokens
	P := len(tokens)

	look, err := sv.m.Lookup(key.Scope{}, tokens, 0)
	if err != nil {
		return err
	}
	matched := look.MatchedBlocks
	c.run.HitTokens += int64(matched * B)
	c.keys = key.AppendChain(c.keys[:0], c.root, tokens[:matched*B], B)
	link := ""
	if matched > 0 {
		link = linkName(c.holderOf(c.keys[0]), s)
	}
	d := sv.arb.Decide(arbiter.Input{
		PromptTokens: P, BlockTokens: B, MatchedBlocks: matched,
		KVBytesPerToken: opt.Preset.KVBytesPerToken, Link: link,
	})
	restored := 0
	if d.RestoreBlocks > 0 {
		if restored, err = c.load(sv, tokens[:d.RestoreBlocks*B]); err != nil {
			return err
		}
	}

	var local, remote int64
	for _, k := range c.keys[:restored/B] {
		if c.holderOf(k) == s {
			local += int64(B)
		} else {
			remote += int64(B)
		}
	}
	kv := opt.Preset.KVBytesPerToken
	localTime := seconds(float64(local*kv) / opt.Preset.LocalBandwidth)
	var remoteTime time.Duration
	if remote > 0 {
		remoteTime = opt.Latency + seconds(float64(remote*kv)/opt.Bandwidth)
	}
	prefill := opt.Preset.Prefill.Time(restored, P)
	c.ttft = append(c.ttft, (localTime+remoteTime+prefill).Seconds()*1e3)
	sv.arb.ObservePrefill(restored, P, prefill)
	if local > 0 {
		sv.arb.ObserveTransfer("local", local*kv, localTime)
	}
	if remote > 0 {
		sv.arb.ObserveTransfer("fabric", remote*kv, remoteTime)
	}
	c.run.RestoredTokens += int64(restored)
	c.run.RemoteRestoredTokens += remote
	c.run.RecomputedTokens += int64(P - restored)

	c.host.Compute(tokens, restored, P)
	if P < B {
		return nil
	}
	return c.save(sv, tokens)
}

// linkName names the link a block comes over, as the bridge does:
// this server's own pool, or any peer's.
func linkName(holder, s int) string {
	if holder == s {
		return "local"
	}
	return "fabric"
}

// load restores tokens (whole blocks) layer by layer and checks every
// restored row; it returns how many tokens arrived intact.
func (c *cluster) load(sv *server, tokens []int32) (int, error) {
	n := len(tokens)
	c.host.Clear(n)
	ld, err := sv.m.LoadBegin(key.Scope{}, c.host.Layout(), tokens, c.cells[:n])
	if err != nil {
		return 0, err
	}
	for l := range c.host.Layers() {
		if _, err := ld.WaitLayer(l); err != nil {
			_, _ = ld.End()
			return 0, err
		}
	}
	res, err := ld.End()
	c.run.Loads++
	if err != nil {
		// A block that fails verification shortens the restore; the rest
		// is recomputed, as the host would.
		c.run.LoadFailures++
	}
	if err := c.host.Check(tokens, res.OKTokens); err != nil {
		return 0, err
	}
	return res.OKTokens, nil
}

// save stores the prompt's new full blocks.
func (c *cluster) save(sv *server, tokens []int32) error {
	save, err := sv.m.SaveBegin(key.Scope{}, c.host.Layout(), tokens, c.cells[:len(tokens)])
	if status.Of(err) == status.PoolFull {
		c.run.SaveShortfalls++
		return nil
	}
	if err != nil {
		return err
	}
	for l := range c.host.Layers() {
		if err := save.SaveLayer(l); err != nil {
			_, _ = save.End()
			return err
		}
	}
	before := sv.b.Stats()
	_, err = save.End()
	switch {
	case status.Of(err) == status.PoolFull:
		c.run.SaveShortfalls++
	case err != nil:
		return err
	}
	// The replay is a sequence: the next request sees what this one
	// published, as it would once the publisher caught up.
	if err := sv.b.Flush(context.Background()); err != nil {
		return err
	}
	after := sv.b.Stats()
	// Deduplicated blocks are ones a peer still held past a block that
	// was evicted: the chain broke before them, the save rewrote them, and
	// the directory kept the peer's copy.
	c.run.SavedBlocks += after.SavedBlocks - before.SavedBlocks
	c.run.DedupedBlocks += after.DedupedBlocks - before.DedupedBlocks
	return nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// percentiles uses the nearest rank, so every reported value is a
// request's own TTFT.
func percentiles(ms []float64) Percentiles {
	if len(ms) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(ms)
	slices.Sort(s)
	rank := func(q float64) float64 {
		i := int(math.Ceil(q*float64(len(s)))) - 1
		return s[min(max(i, 0), len(s)-1)]
	}
	sum := 0.0
	for _, v := range s {
		sum += v
	}
	return Percentiles{P50: rank(0.5), P90: rank(0.9), P99: rank(0.99), Mean: sum / float64(len(s))}
}
