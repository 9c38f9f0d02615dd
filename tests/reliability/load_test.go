package reliability

import (
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/storenode"
)

// loadJob is one load generator's workload: prompts made of one of a few
// shared prefixes and a private suffix, sent one after another until
// Duration has passed.
type loadJob struct {
	ID            int
	Duration      time.Duration
	Prefixes      int // shared prefixes, PrefixBlocks blocks each
	PrefixBlocks  int
	PrivateTokens int
}

// sample is one request: when it started (since the generator began) and
// the time it spent in the bridge (lookup, load, save).
type sample struct {
	AtMS  int64
	Micro int64
}

// loadReport is what a generator sends back when its time is up.
type loadReport struct {
	ID             int
	Requests       int
	Failed         int            // bridge errors that are not a clean fallback
	Wrong          int            // restores whose bytes were not exactly right
	Fallbacks      map[string]int // loads that restored less than decided, by status
	SaveErrors     map[string]int // saves that published nothing, by status
	PromptTokens   int64
	SharedTokens   int64 // tokens of the shared prefixes sent
	DecidedTokens  int64
	RestoredTokens int64
	OverBudget     int   // times resident bytes exceeded the pool
	MaxResident    int64 // bytes
	Blocks         int   // held when the time was up
	Bytes          int64
	PoolBytes      int64
	Stats          bridge.Stats
	RSSKiB, HWMKiB int64
	Errors         []string // the first failures, for the log
	Samples        []sample
}

func (r *loadReport) fail(format string, args ...any) {
	r.Failed++
	if len(r.Errors) < 5 {
		r.Errors = append(r.Errors, fmt.Sprintf(format, args...))
	}
}

// fallbackCodes are the load failures a host handles by recomputing: the
// blocks went away, arrived damaged or late, or had no room.
var fallbackCodes = map[status.Code]bool{
	status.NotFound: true, status.Corrupt: true, status.Transfer: true, status.Timeout: true, status.PoolFull: true,
}

// runLoad is one generator process: lookup, load what the arbiter decided,
// verify every byte, compute the rest, save, until its time is up.
func runLoad(j job) int {
	lj := j.Load
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
	rep := loadReport{ID: lj.ID, Fallbacks: map[string]int{}, SaveErrors: map[string]int{}}
	shared := make([][]int32, lj.Prefixes)
	for i := range shared {
		shared[i] = prompt(int64(1000+i), lj.PrefixBlocks*blockTokens)
	}
	r := rand.New(rand.NewSource(int64(lj.ID)))
	start := time.Now()
	for time.Since(start) < lj.Duration {
		p := shared[r.Intn(len(shared))]
		tokens := append(append([]int32(nil), p...), kvtest.Tokens(r, lj.PrivateTokens)...)
		began := time.Now()
		spent := request(m, h, tokens, &rep)
		rep.Requests++
		rep.PromptTokens += int64(len(tokens))
		rep.SharedTokens += int64(len(p))
		rep.Samples = append(rep.Samples, sample{AtMS: began.Sub(start).Milliseconds(), Micro: spent.Microseconds()})
		_, bytes, poolBytes := b.Resident()
		rep.PoolBytes = poolBytes
		rep.MaxResident = max(rep.MaxResident, bytes)
		if bytes > poolBytes {
			rep.OverBudget++
		}
	}
	rep.Stats = b.Stats()
	rep.Blocks, rep.Bytes, _ = b.Resident()
	rep.RSSKiB, rep.HWMKiB = procMemory("self")
	if err := b.Close(); err != nil {
		rep.fail("close: %v", err)
	}
	out, err := json.Marshal(rep)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("report %s\n", out)
	return 0
}

// request serves one prompt and returns the time spent in the bridge.
func request(m *bridge.Model, h *kvtest.Host, tokens []int32, rep *loadReport) time.Duration {
	cells := kvtest.SeqCells(len(tokens))
	t0 := time.Now()
	lk, err := m.Lookup(key.Scope{}, tokens, 0)
	if err != nil {
		rep.fail("lookup: %v", err)
		return time.Since(t0)
	}
	h.Scribble()
	restored := 0
	if n := lk.RestoreTokens; n > 0 {
		rep.DecidedTokens += int64(n)
		restored = load(m, h, tokens[:n], cells[:n], rep)
		rep.RestoredTokens += int64(restored)
	}
	spent := time.Since(t0)
	if err := verifyRecompute(h, tokens, restored); err != nil {
		rep.Wrong++
		rep.fail("wrong restore: %v", err)
	}
	t1 := time.Now()
	res, err := saveLayers(m, h, key.Scope{}, tokens, cells, layers)
	spent += time.Since(t1)
	switch {
	case err == nil:
	case status.Of(err) == status.Directory || status.Of(err) == status.Timeout || status.Of(err) == status.PoolFull:
		rep.SaveErrors[status.Of(err).String()]++
	default:
		rep.fail("save: %+v, %v", res, err)
	}
	return spent
}

// load restores tokens and returns how many leading tokens arrived.
func load(m *bridge.Model, h *kvtest.Host, tokens []int32, cells []uint32, rep *loadReport) int {
	ld, err := m.LoadBegin(key.Scope{}, h.Layout(), tokens, cells)
	if err != nil {
		if status.Of(err) == status.NotFound {
			rep.Fallbacks[status.NotFound.String()]++
		} else {
			rep.fail("load begin: %v", err)
		}
		return 0
	}
	for l := 0; l < layers; l++ {
		if _, err := ld.WaitLayer(l); err != nil {
			rep.fail("wait layer %d: %v", l, err)
		}
	}
	res, err := ld.End()
	switch {
	case err == nil && res.OKTokens != res.Blocks*blockTokens:
		rep.fail("load restored %d of its %d blocks' tokens without an error", res.OKTokens, res.Blocks)
	case err == nil && res.OKTokens < len(tokens):
		// Blocks evicted between the lookup and the load shorten it.
		rep.Fallbacks["shortened"]++
	case err != nil && fallbackCodes[status.Of(err)]:
		rep.Fallbacks[status.Of(err).String()]++
	case err != nil:
		rep.fail("load end: %v", err)
	}
	return res.OKTokens
}

// procMemory reads a process's resident set and its peak, in KiB.
func procMemory(pid string) (rss, hwm int64) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			rss = n
		case "VmHWM:":
			hwm = n
		}
	}
	return rss, hwm
}

// soakSettings reads MCB_SOAK (a duration: run the long soak) and
// MCB_SOAK_PROCS; without them the run is short enough for CI.
func soakSettings(t *testing.T) (d time.Duration, procs int, soak bool) {
	d, procs = 10*time.Second, 8
	if s := os.Getenv("MCB_SOAK"); s != "" {
		v, err := time.ParseDuration(s)
		require.NoError(t, err, "MCB_SOAK=%q: want a duration such as 10m", s)
		d, soak = v, true
	}
	if s := os.Getenv("MCB_SOAK_PROCS"); s != "" {
		v, err := strconv.Atoi(s)
		require.NoError(t, err, "MCB_SOAK_PROCS=%q: want a positive count", s)
		require.Positive(t, v, "MCB_SOAK_PROCS=%q: want a positive count", s)
		procs = v
	}
	return d, procs, soak
}

// TestLoad runs load generators in several processes against one etcd and
// a store node, with pools small enough that every process evicts, and
// checks that no request fails, no restored byte is wrong, and no pool
// holds more than its size. MCB_SOAK=10m makes it the long soak.
func TestLoad(t *testing.T) {
	d, procs, soak := soakSettings(t)
	srv := etcdtest.Start(t)
	j := newJob("/load", srv.Endpoint())
	j.Config.PoolBytes = 1 << 20 // 30 blocks: a process holds about 3 prompts
	j.Cells = 256
	j.Config.Arbiter.Policy = "cost-model"
	sc := j.Config
	sc.PoolBytes = 4 << 20 // 121 blocks: the store evicts too
	sc.Owner = "store"
	sc.Eviction = "frequency" // as mcbridge serve runs
	store := openNode(t, sc, 64, nil)
	node, err := storenode.New(store.b, storenode.Config{})
	require.NoError(t, err)
	require.NoError(t, node.Replicate())
	lj := loadJob{Duration: d, Prefixes: 4, PrefixBlocks: 8, PrivateTokens: 2*blockTokens + 7}
	var kids []*proc
	for i := 0; i < procs; i++ {
		cj := j
		cj.Config.Owner = fmt.Sprintf("gen-%d", i)
		l := lj
		l.ID = i
		cj.Load = &l
		kids = append(kids, startChild(t, "load", cj))
	}

	var storeMax, storeOver int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				_, bytes, poolBytes := store.b.Resident()
				storeMax = max(storeMax, bytes)
				if bytes > poolBytes {
					storeOver++
				}
			}
		}
	}()
	var reps []loadReport
	for _, k := range kids {
		reps = append(reps, k.report())
	}
	close(stop)
	wg.Wait()

	sum := summarize(reps, soak, d)
	st := store.b.Stats()
	blocks, bytes, poolBytes := store.b.Resident()
	fmt.Fprintf(&sum.text, "\nstore node: %d blocks (%.2f MiB) held of a %.2f MiB pool, peak %.2f MiB; %d copied, %d taken over, %d evicted, %d copy failures\n",
		blocks, mib(bytes), mib(poolBytes), mib(storeMax), st.Replicated, st.TakenOver, st.Evictions, st.ReplicationFails)

	// After every generator has gone, the store publishes every shared
	// prefix, and it restores byte-exact. The store takes over what the
	// generators unpublished as they exited, through the directory's watch:
	// wait for that, not for a time.
	r := openNode(t, j.Config, 256, nil)
	restored := 0
	for i := 0; i < lj.Prefixes; i++ {
		p := append(prompt(int64(1000+i), lj.PrefixBlocks*blockTokens), 1)
		matched := waitMatchedWithin(t, r.m, p, lj.PrefixBlocks, time.Minute)
		if matched < lj.PrefixBlocks {
			continue
		}
		out := r.restore(r.h, key.Scope{}, p)
		r.verify(r.h, p, out.Restored)
		restored += out.Restored
	}
	fmt.Fprintf(&sum.text, "after the generators exited: %d of %d shared-prefix tokens restored from the store; readers reported %d restores of its blocks\n",
		restored, lj.Prefixes*lj.PrefixBlocks*blockTokens, st.PeerUses)
	t.Logf("load report (%d processes, %v):\n%s", procs, d, sum.text.String())
	report(t, fmt.Sprintf("load, %d processes, %v", procs, d), sum.text.String())

	assert.Zero(t, sum.failed, "failed requests")
	assert.Zero(t, sum.wrong, "wrong restores")
	assert.Zero(t, sum.over, "times generators' pools went over their size")
	assert.Zero(t, storeOver, "times the store's pool went over its size")
	assert.NotZero(t, sum.restored, "nothing was shared: no token restored")
	assert.NotZero(t, st.Replicated, "nothing was shared: no block copied by the store")
	assert.Equal(t, lj.Prefixes*lj.PrefixBlocks*blockTokens, restored, "shared-prefix tokens restorable from the store after the generators exited")
	for _, e := range sum.errors {
		t.Log(e)
	}
	if soak {
		assert.NoError(t, sum.latencyDrift())
	}
}

// report reads a generator's report and waits for its exit.
func (p *proc) report() loadReport {
	p.t.Helper()
	var rep loadReport
	line, err := p.out.ReadString('\n')
	require.NoError(p.t, err, "generator said nothing")
	doc, ok := strings.CutPrefix(line, "report ")
	require.True(p.t, ok, "generator said %q", line)
	require.NoError(p.t, json.Unmarshal([]byte(doc), &rep))
	_ = p.stdin.Close()
	assert.NoError(p.t, p.cmd.Wait(), "generator %d", rep.ID)
	p.done = true
	return rep
}

type summary struct {
	text                strings.Builder
	failed, wrong, over int
	restored            int64
	errors              []string
	windows             []window
	windowLen           time.Duration
	driftLimit          float64
	requests            int
}

type window struct {
	from     time.Duration
	n        int
	p50, p99 time.Duration
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// summarize totals the generators' reports and cuts their latencies into
// one-minute windows (one window for a run shorter than two minutes).
func summarize(reps []loadReport, soak bool, d time.Duration) *summary {
	s := &summary{windowLen: time.Minute, driftLimit: 3}
	if d < 2*time.Minute {
		s.windowLen = d + time.Minute
	}
	if v, err := strconv.ParseFloat(os.Getenv("MCB_SOAK_DRIFT"), 64); err == nil && v > 0 {
		s.driftLimit = v
	}
	var prompt, shared, decided int64
	fallbacks, saveErrs := map[string]int{}, map[string]int{}
	var lookups, hits, loads, evictions, saved, deduped, held, peak, reportsSent, reportsFailed int64
	blocks := 0
	var byWindow = map[int][]time.Duration{}
	var rss, hwm []int64
	for _, r := range reps {
		s.requests += r.Requests
		s.failed += r.Failed
		s.wrong += r.Wrong
		s.over += r.OverBudget
		s.restored += r.RestoredTokens
		s.errors = append(s.errors, r.Errors...)
		prompt += r.PromptTokens
		shared += r.SharedTokens
		decided += r.DecidedTokens
		for k, v := range r.Fallbacks {
			fallbacks[k] += v
		}
		for k, v := range r.SaveErrors {
			saveErrs[k] += v
		}
		lookups += r.Stats.Lookups
		hits += r.Stats.Hits
		loads += r.Stats.Loads
		evictions += r.Stats.Evictions
		saved += r.Stats.SavedBlocks
		deduped += r.Stats.DedupedBlocks
		reportsSent += r.Stats.ReportsSent
		reportsFailed += r.Stats.ReportsFailed + r.Stats.ReportsDropped
		blocks += r.Blocks
		held += r.Bytes
		peak = max(peak, r.MaxResident)
		rss, hwm = append(rss, r.RSSKiB), append(hwm, r.HWMKiB)
		for _, sm := range r.Samples {
			w := int(time.Duration(sm.AtMS) * time.Millisecond / s.windowLen)
			byWindow[w] = append(byWindow[w], time.Duration(sm.Micro)*time.Microsecond)
		}
	}
	for w := 0; w < len(byWindow); w++ {
		lat := byWindow[w]
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		if len(lat) == 0 {
			continue
		}
		s.windows = append(s.windows, window{from: time.Duration(w) * s.windowLen, n: len(lat),
			p50: lat[len(lat)/2], p99: lat[min(len(lat)-1, len(lat)*99/100)]})
	}
	t := &s.text
	fmt.Fprintf(t, "requests: %d in %v by %d processes; failed %d, wrong restores %d\n", s.requests, d, len(reps), s.failed, s.wrong)
	fmt.Fprintf(t, "lookups %d, with a hit %d (%.1f%%); loads %d; decided %d tokens, restored %d\n", lookups, hits, pct(hits, lookups), loads, decided, s.restored)
	fmt.Fprintf(t, "token hit ratio: %.1f%% of prompt tokens restored; %.1f%% of the shared-prefix tokens (the ceiling)\n", pct(s.restored, prompt), pct(s.restored, shared))
	fmt.Fprintf(t, "fallbacks (restored less than decided, recomputed): %s; saves that published nothing: %s\n", counts(fallbacks), counts(saveErrs))
	fmt.Fprintf(t, "blocks published %d, deduplicated %d, evicted by generators %d; reports to holders sent %d, failed %d\n", saved, deduped, evictions, reportsSent, reportsFailed)
	fmt.Fprintf(t, "generators held %d blocks (%.2f MiB) at the end; the fullest pool peaked at %.2f MiB\n", blocks, mib(held), mib(peak))
	fmt.Fprintf(t, "generator RSS KiB (now / peak): %s; pools %.2f MiB each, over budget %d times\n", rssPairs(rss, hwm), mib(reps[0].PoolBytes), s.over)
	fmt.Fprintf(t, "bridge time per request (lookup + load + save):\n")
	for _, w := range s.windows {
		fmt.Fprintf(t, "  from %v: %d requests, p50 %v, p99 %v\n", w.from, w.n, w.p50.Round(time.Microsecond), w.p99.Round(time.Microsecond))
	}
	return s
}

// latencyDrift fails the soak when a window's p99 exceeds the median of
// the windows' p99 by more than the drift limit (MCB_SOAK_DRIFT, default
// 3): latency must not grow as the run goes on.
func (s *summary) latencyDrift() error {
	if len(s.windows) < 3 {
		return nil
	}
	p99 := make([]time.Duration, len(s.windows))
	for i, w := range s.windows {
		p99[i] = w.p99
	}
	sort.Slice(p99, func(i, j int) bool { return p99[i] < p99[j] })
	median := p99[len(p99)/2]
	for _, w := range s.windows {
		if float64(w.p99) > s.driftLimit*float64(median) {
			return fmt.Errorf("latency drifted: p99 %v in the window from %v, median p99 %v", w.p99, w.from, median)
		}
	}
	return nil
}

func pct(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * float64(a) / float64(b)
}

func counts(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func rssPairs(rss, hwm []int64) string {
	var parts []string
	for i := range rss {
		parts = append(parts, fmt.Sprintf("%d/%d", rss[i], hwm[i]))
	}
	return strings.Join(parts, " ")
}

// waitMatchedWithin polls Lookup until it matches want blocks or timeout
// passes, and returns the blocks it matched last.
func waitMatchedWithin(t *testing.T, m *bridge.Model, tokens []int32, want int, timeout time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		r, err := m.Lookup(key.Scope{}, tokens, 0)
		require.NoError(t, err)
		if r.MatchedBlocks >= want || time.Now().After(deadline) {
			return r.MatchedBlocks
		}
		time.Sleep(10 * time.Millisecond)
	}
}
