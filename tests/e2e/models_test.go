package e2e

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/llamastate"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

// The models of test-llama-archs have a vocabulary of 128 test tokens
// (none special) and were trained for 256 positions, to which
// llama-server caps a slot's context.
const (
	archVocab    = 128
	archCtxTrain = 256
)

// archSetup is what every server of a model's comparison runs with, and
// the prompts: shared tokens, then the holder's own 40 (A) or the asker's
// 48 (B).
type archSetup struct {
	args             []string
	shared           int
	promptA, promptB []int32
}

// setupArch raises the training context to 4096 for the 1024 shared
// tokens (16 blocks) of the comparison, except for a model with a learned
// position table (GPT-2 and its kind), which has rows for 256 positions
// only: it gets 192 shared tokens (3 blocks), the most that fit.
func setupArch(t testing.TB, model string, extra []string) archSetup {
	f, err := os.Open(model)
	require.NoError(t, err)
	defer f.Close()
	g, err := gguf.Read(f)
	require.NoError(t, err, "%s", model)
	v, ok := g.Lookup("general.architecture")
	require.True(t, ok, "%s has no general.architecture", model)
	arch, _ := v.Str()
	// Flash attention is on unless the run's arguments say otherwise: llama-server
	// warns of an option given twice.
	fa := "on"
	if i := slices.Index(extra, "-fa"); i >= 0 && i+1 < len(extra) {
		fa, extra = extra[i+1], slices.Delete(slices.Clone(extra), i, i+2)
	}
	su := archSetup{args: testenv.ServerArgs(model, 4096, 2, fa), shared: 1024}
	if slices.ContainsFunc(g.Tensors, func(ti gguf.TensorInfo) bool { return ti.Name == "position_embd.weight" }) {
		su.shared = (archCtxTrain - 48) / block * block
	} else {
		su.args = append(su.args, "--override-kv", arch+".context_length=int:4096")
	}
	su.args = append(su.args, extra...)
	prefix := archTokens(su.shared, 7, 3)
	su.promptA = testenv.Cat(prefix, archTokens(40, 11, 5))
	su.promptB = testenv.Cat(prefix, archTokens(48, 13, 9))
	return su
}

// archTokens is n token ids of the test vocabulary, varied by mul and off.
func archTokens(n, mul, off int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32((i*mul + off) % archVocab)
	}
	return t
}

// representatives are the models `make test` runs, one of each memory kind
// and cache shape the bridge serves (docs/models.md): each must restore,
// through each host that does not say (patchedOff, proxyOff) it is off.
// `make test-models` runs every architecture and its table says "off" where
// a host does not serve one.
var representatives = append([]archRun{
	{model: "llama-dense"},                                 // plain attention
	{model: "qwen3-dense"},                                 // MQA (one KV head)
	{model: "qwen3moe-moe"},                                // MoE
	{model: "qwen3vl-dense"},                               // M-RoPE: cells carry a 2-D position and the token
	{model: "deepseek2-moe"},                               // MLA: the cache holds K (the latent) and no V
	{model: "deepseek2-moe", args: []string{"-fa", "off"}}, // MLA whose state says V transposed (of no V)
	{model: "deepseek32-moe"},                              // MLA with an indexer cache (DSA): blocks carry both caches
	{model: "minimax-m3-moe"},                              // attention with an indexer cache (MSA), on its later layers
	// Memories with a partial state, restored from a snapshot beside the blocks
	// (docs/design.md §5.9), which the proxy takes by stopping the prompt at each
	// boundary.
	{model: "gemma3-dense"},                                // sliding window (iSWA): the window cache
	{model: "gpt-oss-moe"},                                 // sliding window, MoE
	{model: "dots3note-moe"},                               // sliding window with an indexer cache (DSA) beside the full-attention MLA cache
	{model: "llama4-moe", proxyOff: prefixInsideTheWindow}, // chunked attention (iSWA by chunks of 8192)
	{model: "qwen35-dense"},                                // hybrid: gated delta-net state, M-RoPE
	{model: "granitehybrid-dense"},                         // hybrid: Mamba 2 state
	// hybrid with an indexer cache (its layers have no V) beside the attention cache
	{model: "qwen4exp-moe"},
	// recurrent: the state alone, so a restore is a snapshot alone
	{model: "mamba2-dense"},
	// a window cache beside a recurrent state, every attention layer in the
	// window (LFM2): a snapshot alone too, through the patched server
	{model: "lfm2-dense", proxyOff: "a hybrid memory with a sliding window"},
	// a token cache beside compressed caches and their rolling states
	// (DeepSeek V4): snapshots of the whole state
	{model: "deepseek4-moe"},
}, quantizedKV(
	quantizedShape{model: "llama-dense"},
	quantizedShape{model: "qwen3-dense"},
	quantizedShape{model: "qwen3vl-dense"},
	quantizedShape{model: "deepseek2-moe", mla: true},
	quantizedShape{model: "deepseek32-moe", mla: true},
	quantizedShape{model: "gemma3-dense"},
	quantizedShape{model: "qwen35-dense"},
)...)

// quantizedShape is a cache shape the quantized-KV runs cover.
type quantizedShape struct {
	model    string
	mla      bool
	proxyOff string // as archRun's
}

// quantizedKV is each shape's runs with q8_0 and q4_0 KV, flash attention
// on and off. llama.cpp quantizes V only with flash attention on, so a run
// with it off quantizes K alone (V stays f16, transposed), and an MLA cache
// only with K and V of one type, so MLA has no run with it off.
func quantizedKV(shapes ...quantizedShape) []archRun {
	var runs []archRun
	for _, s := range shapes {
		for _, typ := range []string{"q8_0", "q4_0"} {
			runs = append(runs, archRun{model: s.model, args: []string{"-ctk", typ, "-ctv", typ}, proxyOff: s.proxyOff})
			if !s.mla {
				runs = append(runs, archRun{model: s.model, args: []string{"-ctk", typ, "-fa", "off"}, proxyOff: s.proxyOff})
			}
		}
	}
	return runs
}

// archException is a model no prefix reuse can serve: why, and what stock
// llama-server answers a completion of a token prompt with.
type archException struct {
	why, stockSays string
}

// archExceptions are the models no prefix reuse can serve. Their run only
// checks that stock still answers them so: one that stock comes to serve
// leaves the list.
var archExceptions = map[string]archException{
	"dream-dense":   diffusion,
	"llada-dense":   diffusion,
	"llada-moe-moe": diffusion,
	"rnd1-moe":      diffusion,
}

// diffusion models denoise a whole sequence in steps with non-causal
// attention: no prefix of it has KV of its own, and llama-server's
// completion does not run them (llama-diffusion-cli does).
var diffusion = archException{
	why:       "diffusion model (non-causal, denoised in steps): no prefix has KV of its own",
	stockSays: "the current context does not logits computation",
}

// archRun is one model and the llama-server arguments of its run beyond
// ServerArgs'. proxyOff, when set, is why the proxy does not serve it, and
// patchedOff what the patched server says when it turns the bridge off for
// it: a representative's run checks that it stays off and answers as stock.
type archRun struct {
	model      string
	args       []string
	proxyOff   string
	patchedOff string
}

// prefixInsideTheWindow is the proxy's row for a sliding-window memory
// whose shared prefix lies inside its first window (Llama 4's chunks are
// 8192 tokens): a window state there holds position 0, and llama-server
// v0.5.0 computes a prompt again after a slot restore of such a state,
// wanting a context checkpoint that no slot file carries
// (host.Model.SnapshotsRestoreAfter). The proxy takes no snapshot there.
const prefixInsideTheWindow = "restored 0 of"

func (r archRun) name() string {
	if len(r.args) == 0 {
		return r.model
	}
	return r.model + " " + strings.Join(r.args, " ")
}

// archRow is a line of docs/models.md.
type archRow struct {
	run                      archRun
	kind                     string
	patched, stored, proxied string
}

// Every architecture test-llama-archs writes (MCB_MODELS_ALL=1, `make
// test-models`) or the representatives: a patched holder computes prefix+A
// and a second patched process, through etcd and the Transfer Engine,
// asks for prefix+B; then, over the real Transfer Engine, a holder that
// exits leaves the prefix to a store node, whose copies a new process
// restores (fromStore); a proxy in front of a stock server does the same
// for another proxy's server. Where the bridge serves the model, the
// asker restores the shared blocks, byte for byte the holder's KV, and
// answers as a stock server in the same cache state; where the patched
// server turns the bridge off, the test records why and checks that the
// answers are still stock's. MCB_MODELS_TABLE=FILE writes the table of the
// run there (docs/models.md).
func TestModels(t *testing.T) {
	dir := testenv.ArchModels(t)
	runs := representatives
	all := os.Getenv("MCB_MODELS_ALL") == "1"
	if all {
		files, err := filepath.Glob(filepath.Join(dir, "*.gguf"))
		require.NoError(t, err)
		require.NotEmpty(t, files, "no models in %s", dir)
		// Every model as it comes, then the representatives' runs with other
		// arguments (flash attention off, quantized KV).
		var variants []archRun
		for _, r := range runs {
			if len(r.args) > 0 {
				variants = append(variants, r)
			}
		}
		runs = nil
		for _, f := range files {
			runs = append(runs, archRun{model: strings.TrimSuffix(filepath.Base(f), ".gguf")})
		}
		runs = append(runs, variants...)
	}
	etcd := etcdtest.Start(t)
	rows := make([]archRow, len(runs))
	if out := os.Getenv("MCB_MODELS_TABLE"); out != "" {
		// After every subtest: the parallel ones end after this function.
		t.Cleanup(func() { assert.NoError(t, os.WriteFile(out, []byte(modelsTable(rows)), 0o644)) })
	}
	// The runs go side by side, as many as go test's -parallel (GOMAXPROCS):
	// each waits on its servers' start-up and its restores more than it
	// computes (one thread a server, testenv.ServerArgs).
	for i, r := range runs {
		row := &rows[i]
		row.run = r
		model := filepath.Join(dir, r.model+".gguf")
		if ex, ok := archExceptions[r.model]; ok {
			t.Run(r.name(), func(t *testing.T) {
				t.Parallel()
				row.patched = "exception: " + ex.why
				row.stored = "exception"
				row.proxied = "exception: stock answers " + strconv.Quote(ex.stockSays)
				su := setupArch(t, model, r.args)
				stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), append(su.args, "-lv", "4"))
				row.kind = memoryKind(t, stock.Log)
				code, body := testenv.PostRaw(t, stock.URL+"/completion", testenv.Request{Prompt: su.promptA, Slot: 0, NPredict: nPredict}.Body())
				assert.NotEqual(t, 200, code, "stock serves %s now: %s", r.model, body)
				assert.Contains(t, string(body), ex.stockSays)
			})
			continue
		}
		t.Run(r.name(), func(t *testing.T) {
			t.Parallel()
			runArch(t, etcd.Endpoint(), fmt.Sprintf("/models/%d", i), model, row, !all)
		})
	}
}

// runArch runs one model through both hosts and fills in row as it goes,
// so that a test that stops half-way leaves what it found; must says that
// both hosts must restore (a representative).
func runArch(t *testing.T, etcd, prefix, model string, row *archRow, must bool) {
	r := row.run
	row.kind, row.patched, row.stored, row.proxied = "?", "(not reached)", "(not reached)", "(not reached)"
	su := setupArch(t, model, r.args)
	args, shared := su.args, su.shared
	// -lv 4: llama.cpp's loading log, which memoryKind reads; it changes no answer.
	ref := testenv.StartLlama(t, "stock", testenv.StockServer(t), append(slices.Clone(args), "-lv", "4"))
	row.kind = memoryKind(t, ref.Log)
	if i := slices.Index(r.args, "-ctk"); i >= 0 && i+1 < len(r.args) {
		require.Contains(t, row.kind, "K "+r.args[i+1], "the KV cache is not of the type asked for")
	}
	reqA := testenv.Request{Prompt: su.promptA, Slot: 0, NPredict: nPredict}
	reqB := testenv.Request{Prompt: su.promptB, Slot: 0, NPredict: nPredict}
	// Stock's answers to prefix+B, by the tokens it holds: both hosts'
	// answers usually come from the same state.
	// A server that restored P tokens of a memory whose window covers them
	// computes the last again, as stock given P tokens does.
	// A hybrid memory with a window (LFM2) given k tokens keeps only what
	// its own context checkpoints give back, fewer than k: its reference is
	// stock's answer from there (stockKept says how many it kept).
	keepsFewer := strings.Contains(row.kind, "hybrid") && strings.Contains(row.kind, "sliding-window")
	stock := map[[2]int][]int32{}
	stockKept := map[[2]int]int{}
	stockAs := func(c testenv.Completion) []int32 {
		k := [2]int{max(c.Timings.CacheN, c.MCB.RestoredN), c.Timings.CacheN}
		if _, ok := stock[k]; !ok {
			if keepsFewer {
				sc := testenv.StockGiven(t, ref.URL, reqB, k[0])
				stock[k], stockKept[k] = sc.Tokens, sc.Timings.CacheN
			} else {
				stock[k] = testenv.StockHolding(t, ref.URL, reqB, k[0], k[1]).Tokens
			}
		}
		return stock[k]
	}
	// stockNote is the row's note on an answer compared with stock's.
	stockNote := func(c testenv.Completion, same bool) string {
		k := [2]int{max(c.Timings.CacheN, c.MCB.RestoredN), c.Timings.CacheN}
		note := ", answers as stock"
		if !same {
			note = ", answers differ from stock"
		}
		if kept, ok := stockKept[k]; ok && kept < k[0] {
			note += fmt.Sprintf(" (given %d tokens, stock keeps %d)", k[0], kept)
		}
		return note
	}

	// The patched server.
	cfg := fmt.Sprintf(`{"block_tokens": %d, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q}, "transport": {"kind": "mooncake", "lib": %q}}`,
		block, etcd, prefix+"/patched", mockTE)
	slots := testenv.SlotDir(t, "patched")
	patchedArgs := append(slices.Clone(args), "--mcb-config", cfg, "--slot-save-path", slots)
	x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), patchedArgs)
	y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), patchedArgs)
	on := x.BridgeState()
	every := snapshotOnly(x.LogLine("mcbridge: on: "))
	// What the holder publishes of the prefix: its blocks, or, of a memory
	// without KV layers, its snapshots alone.
	published := shared / block
	if every > 0 {
		published = shared / every
	}
	x.Complete(t, reqA)
	if on == "on" {
		waitMirrored(t, y.URL, published)
	}
	got := y.Complete(t, reqB)
	same := assert.Equal(t, stockAs(got), got.Tokens,
		"the patched server answers as stock (cache_n %d): %+v", got.Timings.CacheN, got.MCB)
	switch {
	case on != "on":
		row.patched = "off: " + on
		assert.Zero(t, got.MCB.RestoredN, "the bridge is off: %+v", got.MCB)
		if must && (r.patchedOff == "" || !strings.Contains(on, r.patchedOff)) {
			t.Errorf("a representative the patched server does not serve: %s", on)
		}
	case must && r.patchedOff != "":
		t.Errorf("the patched server serves %s now (restored %d): its run says it does not", r.model, got.MCB.RestoredN)
	case got.MCB.RestoredN != shared:
		row.patched = fmt.Sprintf("on, restored %d of %d: %s %s", got.MCB.RestoredN, shared, got.MCB.Decision, got.MCB.Error)
		t.Errorf("the bridge is on and did not restore the shared blocks: %+v", got.MCB)
	case every > 0:
		// No rows to compare: the snapshot is the holder's bytes by its
		// checksum, and llama.cpp read all of it.
		row.patched = fmt.Sprintf("restored %d from a snapshot alone%s", shared, snapshotSize(got.MCB, shared))
	default:
		// Positions the server computed again after the restore are its own.
		row.patched = fmt.Sprintf("restored %d, byte-identical: %v%s", shared, samePrefixKV(t, slots, x, y, got.Timings.CacheN), snapshotSize(got.MCB, shared))
	}
	row.patched += stockNote(got, same)
	x.Stop()
	y.Stop()
	row.stored = "off"
	switch {
	case on == "on" && must && len(r.args) > 0:
		// make test: a store node over the real Transfer Engine for each
		// memory kind; its KV types' variants (which that path carries as
		// it carries any rows) in make test-models.
		row.stored = "(make test-models)"
	case on == "on":
		var sg testenv.Completion
		row.stored, sg = fromStore(t, etcd, prefix+"/store", args, reqA, reqB, published, shared, must)
		row.stored += stockNote(sg, assert.Equal(t, stockAs(sg), sg.Tokens, "from a store node, the patched server answers as stock"))
	}

	// The proxy in front of stock servers.
	pcfg := proxyConfig(etcd, mockTE, prefix+"/proxy")
	var proxies [2]*testenv.Proxy
	for i := range proxies {
		dir := testenv.SlotDir(t, fmt.Sprint("s", i))
		s := testenv.StartLlama(t, fmt.Sprint("s", i), testenv.StockServer(t), append(slices.Clone(args), "--slot-save-path", dir))
		proxies[i] = testenv.StartProxy(t, fmt.Sprint("p", i), s.URL, dir, pcfg)
	}
	testenv.Complete(t, proxies[0].URL, testenv.Request{Prompt: su.promptA, Slot: -1, NPredict: nPredict})
	st := proxies[1].State(t)
	if st["bridge"] == true {
		// A memory without KV layers publishes no blocks: its snapshots alone.
		want := shared / block
		if every, ok := st["snapshot_tokens"].(float64); ok && st["snapshots_only"] == true {
			want = shared / int(every)
		}
		testenv.Eventually(t, defaultWait, func() bool {
			return proxies[1].State(t)["mirrored_blocks"].(float64) >= float64(want)
		}, "the asker's proxy never mirrored the holder's blocks (holder: %v)", testenv.JSON(proxies[0].State(t)))
	}
	got = testenv.Complete(t, proxies[1].URL, testenv.Request{Prompt: su.promptB, Slot: -1, NPredict: nPredict})
	same = assert.Equal(t, stockAs(got), got.Tokens,
		"the proxy answers as stock (cache_n %d)", got.Timings.CacheN)
	switch {
	case st["bridge"] != true:
		row.proxied = fmt.Sprintf("off: %v", st["bridge_off"])
	case got.MCB.RestoredN == shared:
		row.proxied = fmt.Sprintf("restored %d", shared)
	case got.MCB.Error != "":
		row.proxied = fmt.Sprintf("restored %d of %d: %s", got.MCB.RestoredN, shared, got.MCB.Error)
	default:
		row.proxied = fmt.Sprintf("restored %d of %d (holder: %s)", got.MCB.RestoredN, shared, proxyWhy(t, proxies[0]))
	}
	switch {
	case must && r.proxyOff != "":
		assert.Zero(t, got.MCB.RestoredN, "the proxy restored a model it does not serve: %s", row.proxied)
		assert.Contains(t, row.proxied, r.proxyOff, "why the proxy does not serve it")
	case must:
		assert.Equal(t, shared, got.MCB.RestoredN, "a representative: the proxy restores the shared blocks: %s", row.proxied)
	}
	row.proxied += stockNote(got, same)
	t.Logf("%s: patched server: %s; store node, real TE: %s; proxy: %s", row.kind, row.patched, row.stored, row.proxied)
}

// proxyWhy is what a proxy says about its last publish: its state, and
// its log's last line about a save or a publish.
func proxyWhy(t *testing.T, p *testenv.Proxy) string {
	st := p.State(t)
	why := fmt.Sprintf("publishing %v", st["publishing"])
	if off, ok := st["publish_off"]; ok {
		why += ": " + fmt.Sprint(off)
	}
	if every, ok := st["snapshot_tokens"]; ok {
		why += fmt.Sprintf("; snapshots every %v tokens", every)
		if after, ok := st["snapshots_after"]; ok {
			why += fmt.Sprintf(", after the window of %v", after)
		}
	}
	b, _ := os.ReadFile(p.Log)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "publish failed") || strings.Contains(l, "save failed") {
			if _, err, ok := strings.Cut(l, "err="); ok {
				why = strings.Trim(err, `"`)
			}
		}
	}
	return why
}

// fromStore runs prefix+A on a patched holder over the real Transfer
// Engine beside a store node, stops the holder once the store has copied
// the published entries of the prefix (its blocks, snapshots included, or
// its snapshots alone), and restores prefix+B from the store's copies
// into a new process; it returns the row's cell and the answer. must: the
// restore must bring the shared tokens.
func fromStore(t *testing.T, etcd, prefix string, args []string, reqA, reqB testenv.Request, published, shared int, must bool) (string, testenv.Completion) {
	cfg := fmt.Sprintf(`{"block_tokens": %d, "arbiter": {"policy": "always-restore"}, "directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q}, "transport": {"kind": "mooncake", "lib": %q}}`,
		block, etcd, prefix, testenv.RealTE(t))
	store := testenv.StartStore(t, "store", cfg, "--pool-bytes", fmt.Sprint(256<<20))
	defer store.Stop()
	withBridge := append(slices.Clone(args), "--mcb-config", cfg)
	h := testenv.StartLlama(t, "holder", testenv.PatchedServer(t), withBridge)
	h.Complete(t, reqA)
	waitStore(t, store, "the prefix copied", func(s storeState) bool { return s.Stats.Replicated >= published })
	h.Stop()
	waitStore(t, store, "the prefix published as the store's", func(s storeState) bool { return s.Stats.TakenOver >= published })
	y := testenv.StartLlama(t, "asker", testenv.PatchedServer(t), withBridge)
	defer y.Stop()
	waitMirrored(t, y.URL, published)
	got := y.Complete(t, reqB)
	if must {
		assert.Equal(t, shared, got.MCB.RestoredN, "a representative restores the shared blocks from a store node: %+v", got.MCB)
	}
	if got.MCB.RestoredN != shared {
		return fmt.Sprintf("restored %d of %d: %s %s", got.MCB.RestoredN, shared, got.MCB.Decision, got.MCB.Error), got
	}
	return fmt.Sprintf("restored %d", shared), got
}

// snapshotSize is the row's note on the snapshot a restore of n tokens
// brought, against a block's KV: "" for a restore without one.
func snapshotSize(o testenv.Outcome, n int) string {
	if o.RestoredSnapshotBytes == 0 {
		return ""
	}
	kib := func(b int64) string { return strconv.FormatFloat(float64(b)/1024, 'f', 1, 64) }
	if rows := o.RestoredBytes - o.RestoredSnapshotBytes; rows > 0 {
		return fmt.Sprintf(" (snapshot %s KiB, a block's KV %s KiB)", kib(o.RestoredSnapshotBytes), kib(rows/int64(n/block)))
	}
	return fmt.Sprintf(" (snapshot %s KiB)", kib(o.RestoredSnapshotBytes))
}

// snapshotOnly is, from a patched server's "mcbridge: on" line, how many
// tokens apart it snapshots a memory without KV layers, whose snapshots
// are all it publishes; 0 for a memory with KV layers.
func snapshotOnly(on string) int {
	m := snapshotOnlyLine.FindStringSubmatch(on)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

var snapshotOnlyLine = regexp.MustCompile(`no KV layers; .*, snapshotted every (\d+) tokens`)

// samePrefixKV saves slot 0 of x and of y (into their slot directory
// slots) and checks that their first n positions are the same bytes:
// cells, cell extensions, K and V.
func samePrefixKV(t *testing.T, slots string, x, y *testenv.Llama, n int) bool {
	var prefixes [2][]byte
	for i, s := range []*testenv.Llama{x, y} {
		name := fmt.Sprintf("prefix-%d.bin", i)
		testenv.Post(t, s.URL+"/slots/0?action=save", map[string]any{"filename": name}, nil)
		path := filepath.Join(slots, name)
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		prefixes[i] = prefixKV(t, b, n, path)
	}
	return assert.True(t, slices.Equal(prefixes[0], prefixes[1]), "the restored prefix is the holder's KV, byte for byte")
}

// prefixKV is the state of positions [0, n) of a slot file's KV: of the
// attention cache and, where the state holds an indexer cache too (DSA, MSA
// and dots3 right after the attention cache, qwen4exp after its recurrent
// state; each keeps every position), of that cache too. A window cache's
// state or a recurrent state is the partial state, restored from a
// snapshot.
func prefixKV(t *testing.T, b []byte, n int, path string) []byte {
	st, rest, err := llamastate.ParseLeading(b)
	require.NoError(t, err, "slot file %s", path)
	sl, err := st.Slice(n)
	require.NoError(t, err, "positions [0, %d) of %s", n, path)
	out, err := sl.Build()
	require.NoError(t, err)
	if idx := indexerCache(b[len(b)-rest:], st); idx != nil {
		// A window cache lacks the positions it has moved past.
		if isl, err := idx.Slice(n); err == nil {
			more, err := isl.Build()
			require.NoError(t, err)
			out = append(out, more...)
		}
	}
	return out
}

// indexerCache is the KV cache state that rest, what a state holds after
// st's first cache, starts with, or else ends with after a recurrent state
// (llama_memory_hybrid_idx writes its indexer's last, in a variant of its
// own: no V), which the test finds by trying each offset whose stream count
// is st's, as a state of st's framing; nil when there is none.
func indexerCache(rest []byte, st *llamastate.State) *llamastate.State {
	of := func(ss []llamastate.Stream, kOnly bool) *llamastate.State {
		return &llamastate.State{Kind: st.Kind, SeqID: st.SeqID, Words: st.Words, Streams: ss, CellExt: st.CellExt, KOnly: kOnly}
	}
	if second, _, err := llamastate.ParseCacheLeading(rest, st.CellExt, st.KOnly); err == nil {
		return of(second, st.KOnly)
	}
	if _, err := llamastate.RecurrentPos(rest); err != nil {
		return nil
	}
	for o := 12; o+4 <= len(rest); o++ {
		if int(binary.LittleEndian.Uint32(rest[o:])) != len(st.Streams) {
			continue
		}
		for _, kOnly := range []bool{true, false} {
			if second, err := llamastate.ParseCache(rest[o:], st.CellExt, kOnly); err == nil {
				return of(second, kOnly)
			}
		}
	}
	return nil
}

var (
	ropeType  = regexp.MustCompile(`rope type\s+= (-?\d+)`)
	headCount = regexp.MustCompile(`n_head\s+= (.*)`)
	kvHeads   = regexp.MustCompile(`n_head_kv\s+= (.*)`)
	experts   = regexp.MustCompile(`n_expert\s+= (\d+)`)
	kvTypes   = regexp.MustCompile(`llama_kv_cache: size = .*, K \((\w+)\): .*, V \((\w+)\)`)
)

// memoryKind names a model's memory and cache shape from what a stock
// llama-server logs loading it (llama-model.cpp print_info, the caches'
// constructors).
func memoryKind(t *testing.T, logPath string) string {
	// llama.cpp writes its log from a thread of its own, which can lag
	// behind /health on a loaded machine: "model loaded" follows every
	// line read here.
	var log string
	testenv.Eventually(t, 30*time.Second, func() bool {
		b, err := os.ReadFile(logPath)
		require.NoError(t, err)
		log = string(b)
		return strings.Contains(log, "model loaded")
	}, "%s: no \"model loaded\" in the log", logPath)
	attn := strings.Contains(log, "llama_kv_cache: size =")
	var kind []string
	switch {
	case strings.Contains(log, "llama_memory_recurrent") && attn:
		kind = append(kind, "hybrid")
	case strings.Contains(log, "llama_memory_recurrent"):
		kind = append(kind, "recurrent")
	}
	// llama_kv_cache_iswa's line, and llama_kv_cache_dsa_iswa's.
	if strings.Contains(log, "creating     SWA KV cache") || strings.Contains(log, "creating SWA KV cache") {
		kind = append(kind, "sliding-window")
	}
	if strings.Contains(log, "llama_kv_cache_dsv4:") {
		kind = append(kind, "compressed caches")
	}
	if strings.Contains(log, "n_lora_kv") {
		kind = append(kind, "MLA")
	}
	if m := ropeType.FindStringSubmatch(log); m != nil {
		// GGML_ROPE_TYPE_MROPE, _IMROPE: the cells carry 2-D positions
		if v, _ := strconv.Atoi(m[1]); v == 8 || v == 40 {
			kind = append(kind, "M-RoPE")
		}
	}
	if strings.Contains(log, "causal attn           = 0") {
		kind = append(kind, "non-causal")
	}
	if h, kv := headCount.FindStringSubmatch(log), kvHeads.FindStringSubmatch(log); h != nil && kv != nil && h[1] != kv[1] && attn {
		kind = append(kind, "GQA/MQA")
	}
	if len(kind) == 0 {
		kind = append(kind, "plain")
	}
	if m := experts.FindStringSubmatch(log); m != nil && m[1] != "0" {
		kind = append(kind, "MoE")
	}
	if m := kvTypes.FindStringSubmatch(log); m != nil && (m[1] != "f16" || m[2] != "f16") {
		kind = append(kind, fmt.Sprintf("K %s, V %s", m[1], m[2]))
	}
	return strings.Join(kind, ", ")
}

// modelsTable is docs/models.md for a run.
func modelsTable(rows []archRow) string {
	var b strings.Builder
	b.WriteString(`# Every architecture

Written by ` + "`make test-models`" + ` (tests/e2e, TestModels): the random-weight model of
every architecture that the pinned llama.cpp's tests/test-llama-archs.cpp writes
(` + "`test-llama-archs -s 42 -o DIR`" + `, scripts/llama/archs.sh), with token prompts of
1024 shared (192 for a model with a learned position table of 256 rows) and 40 or 48
own tokens. "patched server": a holder computes prefix+A,
a second patched process asks for prefix+B through etcd and the mock Transfer Engine.
"store node, real TE": a patched holder over the real Transfer Engine computes prefix+A
beside an ` + "`mcbridge serve`" + ` store node and exits once the store has copied what it
published; a new patched process restores prefix+B from the store's copies.
"proxy": the same through two ` + "`mcbridge proxy`" + ` processes in front of stock servers.
A memory with a partial state names the size of the snapshot its restore brought, and of
one block's KV (` + "`block_tokens`" + ` positions), as measured on these models.
Every answer is compared with a stock server's in the same cache state. "off" is
what the patched server logs (` + "`mcbridge: off: <why>`" + `) or the proxy's state says.
` + "`make test`" + ` runs the representatives of tests/e2e/models_test.go.

| model | memory kind | patched server | store node, real TE | proxy |
|---|---|---|---|---|
`)
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", r.run.name(), r.kind, r.patched, r.stored, r.proxied)
	}
	return b.String()
}
