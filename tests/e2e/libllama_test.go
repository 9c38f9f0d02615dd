package e2e

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/testenv"
)

func libllamaTest(t *testing.T, variant string) string {
	dir := os.Getenv(testenv.EnvLibllama)
	require.NotEmpty(t, dir, "%s is not set: it names the build of csrc/embed (make test sets it)", testenv.EnvLibllama)
	bin := filepath.Join(dir, "libllama_test"+variant)
	_, err := os.Stat(bin)
	require.NoError(t, err)
	return bin
}

// The libllama host against real llama.cpp contexts
// (csrc/embed/tests/libllama_test.cpp), plain and under ASan and UBSan
// with a leak check at exit: round trips into contexts of other shapes with
// the KV byte-identical and the next token's logits bit-identical,
// mismatches, a restore llama.cpp refuses, and partial loads under the mock
// Transfer Engine's faults.
func TestLibllamaHost(t *testing.T) {
	model, other := testenv.Model(t, "tiny", 0), testenv.Model(t, "tiny", 2)
	for _, variant := range []string{"", "_asan"} {
		t.Run("variant"+variant, func(t *testing.T) {
			cmd := exec.Command(libllamaTest(t, variant), model, other, mockTE)
			cmd.Env = append(os.Environ(), "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1", "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1")
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			assert.Contains(t, string(out), ", 0 failed")
			for _, line := range strings.Split(string(out), "\n") {
				if strings.HasPrefix(line, "PASS ") || strings.HasPrefix(line, "FAIL ") {
					t.Log(line)
				}
			}
		})
	}
}

// Two processes: one embedder saves and serves its pool, another restores
// through etcd and the Transfer Engine, with the KV byte-identical to the
// saver's and logits bit-identical to a full prefill.
func TestLibllamaTwoProcesses(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	for name, te := range transports(t) {
		t.Run(name, func(t *testing.T) {
			etcd := etcdtest.Start(t)
			libllamaTwoProcesses(t, model, etcd.Endpoint(), "/libllama", te)
		})
	}
}

// The libllama host decides what it serves by the probe's state, as the
// patched server does by the memory, and not by llama_model_n_swa: EXAONE 4
// names a window and runs one plain cache, DeepSeek 2's MLA cache holds K
// and no V, DeepSeek 3.2's memory is two caches that keep every position
// (the MLA cache and its indexer's, llama_kv_cache_dsa), and each restores
// across two processes. Gemma 3's sliding-window
// memory (llama_kv_cache_iswa) writes two caches, but its states keep only
// the window cache's last window, which turns the host off with that
// reason, the context computing as a fresh one.
func TestLibllamaModels(t *testing.T) {
	dir := testenv.ArchModels(t)
	etcd := etcdtest.Start(t)
	for i, m := range []string{"exaone4-dense", "deepseek2-moe", "deepseek32-moe"} {
		t.Run(m, func(t *testing.T) {
			libllamaTwoProcesses(t, filepath.Join(dir, m+".gguf"), etcd.Endpoint(), fmt.Sprintf("/libllama-models/%d", i), mockTE)
		})
	}
	t.Run("gemma3-dense", func(t *testing.T) {
		out, err := exec.Command(libllamaTest(t, ""), "xoff", filepath.Join(dir, "gemma3-dense.gguf")).CombinedOutput()
		require.NoError(t, err, "%s", out)
		assert.Regexp(t, `PASS off: mcb_model_register_state: unsupported: a memory of several caches: a sliding-window memory \(window \d+\): its states keep only the last window of the window layers`, string(out))
		logPass(t, string(out))
	})
}

// libllamaTwoProcesses runs libllama_test's xsave and xrestore on model
// through etcd under prefix and the Transfer Engine te.
func libllamaTwoProcesses(t *testing.T, model, etcd, prefix, te string) {
	cfg := fmt.Sprintf(`{"directory": {"kind": "etcd", "endpoints": [%q], "prefix": %q}, "transport": {"kind": "mooncake", "lib": %q}, "arbiter": {"policy": "always-restore"}, "pool_bytes": 16777216}`,
		etcd, prefix, te)
	ready := filepath.Join(t.TempDir(), "ready")
	saver := exec.Command(libllamaTest(t, ""), "xsave", model, cfg, ready)
	stdin, err := saver.StdinPipe()
	require.NoError(t, err)
	out, err := os.Create(filepath.Join(t.TempDir(), "xsave.log"))
	require.NoError(t, err)
	saver.Stdout, saver.Stderr = out, out
	require.NoError(t, saver.Start())
	defer func() {
		_ = saver.Process.Kill()
		_ = saver.Wait()
	}()
	testenv.Eventually(t, defaultWait, func() bool { _, err := os.Stat(ready); return err == nil }, "the saver never got ready")
	res, err := exec.Command(libllamaTest(t, ""), "xrestore", model, cfg, ready).CombinedOutput()
	require.NoError(t, err, "%s", res)
	assert.Contains(t, string(res), "PASS two processes")
	require.NoError(t, stdin.Close())
	done := make(chan error, 1)
	go func() { done <- saver.Wait() }()
	select {
	case err := <-done:
		log, _ := os.ReadFile(out.Name())
		require.NoError(t, err, "%s", log)
	case <-time.After(defaultWait):
		require.FailNow(t, "the saver did not exit")
	}
	logPass(t, string(res))
}

// logPass logs the PASS lines of libllama_test's output.
func logPass(t *testing.T, out string) {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "PASS") {
			t.Log(sc.Text())
		}
	}
}
