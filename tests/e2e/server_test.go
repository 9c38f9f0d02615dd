package e2e

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

const block = 64

var (
	prefix  = testenv.Tokens(600, 7, 3)
	shared  = len(prefix) / block * block
	promptA = testenv.Cat(prefix, testenv.Tokens(50, 11, 5))
	promptB = testenv.Cat(prefix, testenv.Tokens(70, 13, 9))
	promptC = testenv.Cat(prefix, testenv.Tokens(40, 17, 1))
)

const nPredict = 16

func bridgeConfig(extra string) string {
	return `{"block_tokens": 64` + extra + `}`
}

// stripHooks is a patched file without its "#ifdef LLAMA_MCBRIDGE ...
// #endif" blocks (the series never nests them).
func stripHooks(t *testing.T, path string) string {
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []string
	skip := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "#ifdef LLAMA_MCBRIDGE":
			skip = true
		case skip && line == "#endif":
			skip = false
		case !skip:
			out = append(out, line)
		}
	}
	require.NoError(t, sc.Err())
	return strings.Join(out, "\n")
}

func withoutBlankLines(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.TrimSpace(l) != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The patch series only inserts call sites: every file it touches, minus
// its LLAMA_MCBRIDGE blocks, is the pristine file, and the top-level
// CMakeLists.txt gains only the if (MCBRIDGE_ROOT) hook.
func TestPatchesOnlyInsertHooks(t *testing.T) {
	patched := testenv.PatchedServer(t)
	patchedSrc := filepath.Join(filepath.Dir(filepath.Dir(filepath.Dir(patched))), "src")
	pristine := filepath.Join(filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(patched)))), "src")
	series, err := filepath.Glob(filepath.Join(testenv.Root(), "llama-patches", "[0-9]*.patch"))
	require.NoError(t, err)
	require.NotEmpty(t, series)
	files := map[string]bool{}
	for _, p := range series {
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		for _, line := range strings.Split(string(b), "\n") {
			if f, ok := strings.CutPrefix(line, "+++ b/"); ok {
				files[f] = true
			}
		}
	}
	require.NotEmpty(t, files)
	for f := range files {
		if f == "CMakeLists.txt" {
			b, err := os.ReadFile(filepath.Join(patchedSrc, f))
			require.NoError(t, err)
			assert.Contains(t, string(b), "if (MCBRIDGE_ROOT)\n", "the CMake hook")
			continue
		}
		want, err := os.ReadFile(filepath.Join(pristine, f))
		require.NoError(t, err)
		assert.Equal(t, withoutBlankLines(string(want)), withoutBlankLines(stripHooks(t, filepath.Join(patchedSrc, f))),
			"%s differs from the pristine file outside LLAMA_MCBRIDGE blocks", f)
	}
}

// Stage 2 inside one process against real llama_contexts
// (csrc/testing/llama-mcbridge-test.cpp): byte-identical K and V
// after a restore into scattered cells with flash attention on and off,
// mismatches restoring nothing, rollback, clean marks.
// The same over a memory of an MLA cache and its indexer's (DeepSeek 3.2,
// llama_kv_cache_dsa), whose blocks carry both caches' layers; and over
// memories without KV layers (Mamba 2, LFM2 with a window, DeepSeek V4),
// restored from a snapshot alone, byte for byte the state it was taken from.
func TestStage2Contexts(t *testing.T) {
	bin := filepath.Join(filepath.Dir(testenv.PatchedServer(t)), "llama-mcbridge-test")
	archs := testenv.ArchModels(t)
	for _, run := range []struct{ name, model, other string }{
		{"plain", testenv.Model(t, "tiny", 0), testenv.Model(t, "tiny", 2)},
		{"dsa", filepath.Join(archs, "deepseek32-moe.gguf"), filepath.Join(archs, "deepseek2-moe.gguf")},
		// Memories without KV layers: a recurrent state, and a window cache beside one.
		{"recurrent", filepath.Join(archs, "mamba2-dense.gguf"), filepath.Join(archs, "mamba-dense.gguf")},
		{"window-recurrent", filepath.Join(archs, "lfm2-dense.gguf"), filepath.Join(archs, "mamba2-dense.gguf")},
		// DeepSeek V4's compressed caches: snapshots of the whole state.
		{"whole-state", filepath.Join(archs, "deepseek4-moe.gguf"), filepath.Join(archs, "mamba-dense.gguf")},
	} {
		t.Run(run.name, func(t *testing.T) {
			out, err := exec.Command(bin, run.model, run.other).CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Contains(t, string(out), "all checks passed")
			t.Logf("%d checks passed", strings.Count(string(out), "\nok "))
		})
	}
}

// modes are the server settings a shared prefix must work under: flash
// attention on (V by rows) and off (V transposed), and one KV stream
// shared by the slots.
var modes = []struct {
	name, fa string
	kvu      bool
}{{"fa-on", "on", false}, {"fa-off", "off", false}, {"fa-on-kvu", "on", true}}

func serverArgs(model, fa string, kvu bool) []string {
	a := testenv.ServerArgs(model, 4096, 2, fa)
	if kvu {
		a = append(a, "-kvu")
	}
	return a
}

// threeRequests are prefix+A on slot 0, prefix+B on slot 1 and prefix+C on
// slot 0.
var threeRequests = []testenv.Request{
	{Prompt: promptA, Slot: 0, NPredict: nPredict},
	{Prompt: promptB, Slot: 1, NPredict: nPredict},
	{Prompt: promptC, Slot: 0, NPredict: nPredict},
}

// threePrompts runs threeRequests in that order.
func threePrompts(t *testing.T, url string) []testenv.Completion {
	var out []testenv.Completion
	for _, r := range threeRequests {
		out = append(out, testenv.Complete(t, url, r))
	}
	return out
}

// One patched server, two slots: slot 1 restores the full blocks slot 0
// computed, slot 0 keeps its own longer prefix, every answer is stock's;
// without a configuration the patched server is stock.
func TestOneServerTwoSlots(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), serverArgs(model, m.fa, m.kvu))
			want := threePrompts(t, stock.URL)

			off := testenv.StartLlama(t, "off", testenv.PatchedServer(t), serverArgs(model, m.fa, m.kvu), "MCB_CONFIG=")
			gotOff := threePrompts(t, off.URL)
			assert.Equal(t, "", off.BridgeState(), "no configuration: a stock server, no mcbridge log line")
			assert.NotContains(t, string(testenv.Get(t, off.URL+"/metrics")), "mcbridge_", "no configuration: no mcbridge series")
			off.Stop()
			for i := range want {
				assert.Equal(t, want[i].Tokens, gotOff[i].Tokens, "bridge off, prompt %d", i)
				assert.Empty(t, gotOff[i].MCB.Decision, "bridge off, prompt %d: no mcbridge object", i)
			}

			on := testenv.StartLlama(t, "on", testenv.PatchedServer(t), append(serverArgs(model, m.fa, m.kvu), "--mcb-config", bridgeConfig("")))
			require.Equal(t, "on", on.BridgeState())
			got := threePrompts(t, on.URL)
			metrics := testenv.Metrics(t, on.URL+"/metrics")
			for i, r := range threeRequests {
				assert.Equal(t, testenv.StockFrom(t, stock.URL, r, got[i].Timings.CacheN).Tokens, got[i].Tokens, "prompt %d: the same tokens as stock", i)
			}
			assert.Equal(t, []any{"miss", 0}, []any{got[0].MCB.Decision, got[0].MCB.RestoredN}, "slot 0 finds nothing")
			assert.Equal(t, []any{"restore", shared, shared}, []any{got[1].MCB.Decision, got[1].MCB.RestoredN, got[1].Timings.CacheN},
				"slot 1 restores the shared full blocks")
			assert.Equal(t, []any{"local", 0, len(prefix)}, []any{got[2].MCB.Decision, got[2].MCB.RestoredN, got[2].Timings.CacheN},
				"slot 0 keeps its own longer prefix")
			assert.Equal(t, float64(shared), metrics["mcbridge_restored_tokens_total"], "/metrics counts the restored tokens")
			assert.Equal(t, float64(1), metrics["mcbridge_up"], "mcbridge_up")
		})
	}
}

// A configuration the bridge refuses leaves the server as stock, says so
// in its log and in mcbridge_up, and answers as stock.
func TestRefusedConfig(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), serverArgs(model, "on", false))
	want := stock.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	bad := testenv.StartLlama(t, "bad", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", `{"no_such_key": 1}`))
	got := bad.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
	assert.Equal(t, want.Tokens, got.Tokens)
	assert.Contains(t, bad.BridgeState(), "no_such_key")
	metrics := string(testenv.Get(t, bad.URL+"/metrics"))
	assert.Contains(t, metrics, `mcbridge_up{reason=`)
	assert.Contains(t, metrics, "no_such_key", "mcbridge_up says why")
}

// Blocks saved under one tenant are invisible to another.
func TestTenants(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	p2 := testenv.Tokens(600, 3, 100)
	s := testenv.StartLlama(t, "tenants", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", bridgeConfig("")))
	tenant := func(name string) map[string]any { return map[string]any{"mcb_tenant": name} }
	s.Complete(t, testenv.Request{Prompt: testenv.Cat(p2, testenv.Tokens(30, 5, 2)), Slot: 0, NPredict: 4, Extra: tenant("alpha")})
	beta := s.Complete(t, testenv.Request{Prompt: testenv.Cat(p2, testenv.Tokens(30, 7, 3)), Slot: 1, NPredict: 4, Extra: tenant("beta")})
	s.Complete(t, testenv.Request{Prompt: testenv.Tokens(300, 9, 50), Slot: 1, NPredict: 4}) // slot 1 forgets p2
	alpha := s.Complete(t, testenv.Request{Prompt: testenv.Cat(p2, testenv.Tokens(30, 11, 4)), Slot: 1, NPredict: 4, Extra: tenant("alpha")})
	assert.Equal(t, []any{"miss", 0}, []any{beta.MCB.Decision, beta.MCB.RestoredN}, "tenant beta does not see alpha's blocks")
	assert.Equal(t, []any{"restore", shared}, []any{alpha.MCB.Decision, alpha.MCB.RestoredN}, "tenant alpha does")
}

// transports are the Transfer Engines the cross-process tests run over:
// the mock and the real library.
func transports(t *testing.T) map[string]string {
	return map[string]string{"mock": mockTE, "real": testenv.RealTE(t)}
}

// Two patched servers in two processes share KV through etcd and the
// Transfer Engine; a model or configuration mismatch restores nothing; a
// restore from a killed holder falls back to computing, with stock's
// answer.
func TestTwoServers(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	other := testenv.Model(t, "tiny", 2)
	stock := testenv.StartLlama(t, "stock", testenv.StockServer(t), serverArgs(model, "on", false))
	reqB := testenv.Request{Prompt: promptB, Slot: 1, NPredict: nPredict}
	for name, te := range transports(t) {
		t.Run(name, func(t *testing.T) {
			etcd := etcdtest.Start(t)
			cfg := bridgeConfig(`, "directory": {"kind": "etcd", "endpoints": ["` + etcd.Endpoint() + `"]}, "transport": {"kind": "mooncake", "lib": "` + te + `"}`)
			x := testenv.StartLlama(t, "x", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
			require.Equal(t, "on", x.BridgeState())
			y := testenv.StartLlama(t, "y", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
			x.Complete(t, testenv.Request{Prompt: promptA, Slot: 0, NPredict: nPredict})
			waitMirrored(t, y.URL, shared/block)
			got := y.Complete(t, reqB)
			assert.Equal(t, []any{"restore", shared}, []any{got.MCB.Decision, got.MCB.RestoredN}, "y restores what x computed: %+v", got.MCB)
			assert.Equal(t, testenv.StockFrom(t, stock.URL, reqB, got.Timings.CacheN).Tokens, got.Tokens, "y answers as stock")
			y.Stop()

			for _, v := range []struct {
				name string
				args []string
			}{
				{"other weights", serverArgs(other, "on", false)},
				{"K bf16", append(serverArgs(model, "on", false), "-ctk", "bf16")},
				{"flash attention off", serverArgs(model, "off", false)},
			} {
				s := testenv.StartLlama(t, v.name, testenv.PatchedServer(t), append(v.args, "--mcb-config", cfg))
				got := s.Complete(t, testenv.Request{Prompt: promptB, Slot: 1, NPredict: 4})
				s.Stop()
				assert.Equal(t, []any{"miss", 0}, []any{got.MCB.Decision, got.MCB.RestoredN}, "%s against x: nothing restored", v.name)
			}

			// x dies without unpublishing; its entries outlive it until its
			// lease runs out, so a new server finds the blocks, fails to
			// read them, and computes the prompt.
			x.Kill()
			z := testenv.StartLlama(t, "z", testenv.PatchedServer(t), append(serverArgs(model, "on", false), "--mcb-config", cfg))
			waitMirrored(t, z.URL, shared/block)
			got = z.Complete(t, reqB)
			assert.Equal(t, []any{"failed", 0, 0}, []any{got.MCB.Decision, got.MCB.RestoredN, got.Timings.CacheN},
				"x killed: z's restore fails (%s)", got.MCB.Error)
			assert.Equal(t, testenv.StockFrom(t, stock.URL, reqB, 0).Tokens, got.Tokens, "x killed: z computes the prompt and answers as stock")
		})
	}
}

// waitMirrored waits until a server's (or proxy's) directory mirror holds
// at least n blocks: publishing and the watch are asynchronous.
func waitMirrored(t testing.TB, url string, n int) {
	t.Helper()
	testenv.Eventually(t, defaultWait, func() bool {
		return testenv.Metrics(t, url+"/metrics")["mcbridge_mirrored_blocks"] >= float64(n)
	}, "%s's mirror never held %d blocks", url, n)
}
