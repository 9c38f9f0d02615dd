package main

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/metrics"
	"github.com/mcbridge/mcbridge/internal/status"
)

// metricsText is the whole text for a bridge, read as a host does: ask
// for the length, then read into a buffer that holds it.
func (f *fixture) metricsText(t testing.TB, b uint64, off unsafe.Pointer) string {
	t.Helper()
	n := mcbgo_metrics_text(b, off, nil, 0)
	require.NotZero(t, n)
	buf := f.c.alloc(t, int(n)+1, 1)
	require.Equal(t, n, mcbgo_metrics_text(b, off, pointer(buf), n+1), "the length changed between two reads")
	require.Zero(t, buf[n], "the text is not terminated")
	text := string(buf[:n])
	require.NotContains(t, text, "\x00")
	return text
}

var sampleRE = regexp.MustCompile(`^(` + metrics.Prefix + `[a-z_]+)(\{([a-z]+)="((?:[^"\\]|\\.)*)"\})? (-?\d+)$`)

// checkExposition checks the text against the vocabulary: every series
// has its HELP and TYPE, in order, and every sample is one of them.
func checkExposition(t *testing.T, text string) map[string][]string {
	t.Helper()
	require.True(t, strings.HasSuffix(text, "\n"), "the text ends in a newline")
	samples := map[string][]string{}
	next := 0
	var current *metrics.Series
	for _, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		if strings.HasPrefix(line, "# HELP ") {
			require.Less(t, next, len(metrics.Vocabulary), "a series beyond the vocabulary: %q", line)
			current = &metrics.Vocabulary[next]
			next++
			assert.Equal(t, "# HELP "+metrics.Prefix+current.Name+" "+current.Help, line)
			continue
		}
		require.NotNil(t, current, "a line before the first series: %q", line)
		if strings.HasPrefix(line, "# TYPE ") {
			assert.Equal(t, "# TYPE "+metrics.Prefix+current.Name+" "+current.Kind, line)
			continue
		}
		m := sampleRE.FindStringSubmatch(line)
		require.NotNil(t, m, "not a sample: %q", line)
		assert.Equal(t, metrics.Prefix+current.Name, m[1], "a sample under another series' HELP")
		if m[2] != "" {
			assert.Equal(t, current.Label, m[3], "%s split by another label", m[1])
		}
		samples[m[1]] = append(samples[m[1]], line)
	}
	assert.Equal(t, len(metrics.Vocabulary), next, "series written")
	return samples
}

func TestMetricsText(t *testing.T) {
	f := newFixture(t)
	b := f.open(t, f.config(""))
	m := f.register(t, b, testModel(false).reg(t, f.c))
	tok := prompt(31, 0, 31)
	f.peek(t, m, nil, tok, 31)
	f.peek(t, m, nil, tok, 31)

	text := f.metricsText(t, b, nil)
	samples := checkExposition(t, text)
	assert.Equal(t, []string{"mcbridge_up 1"}, samples["mcbridge_up"])
	assert.Equal(t, []string{"mcbridge_lookups_total 2"}, samples["mcbridge_lookups_total"])
	assert.Equal(t, []string{"mcbridge_lookup_misses_total 2"}, samples["mcbridge_lookup_misses_total"])
	assert.Equal(t, []string{"mcbridge_pool_bytes 16777216"}, samples["mcbridge_pool_bytes"])

	t.Run("truncated", func(t *testing.T) {
		n := uint64(len(text))
		buf := f.c.alloc(t, len(text)+16, 1)
		for _, capacity := range []uint64{1, 2, 7, n / 2, n - 1, n, n + 1, n + 15} {
			copy(buf, bytes.Repeat([]byte{'Z'}, len(buf)))
			assert.Equal(t, n, mcbgo_metrics_text(b, nil, pointer(buf), capacity), "cap %d: the whole length", capacity)
			k := min(capacity-1, n)
			assert.Equal(t, text[:k], string(buf[:k]), "cap %d", capacity)
			assert.Zero(t, buf[k], "cap %d: not terminated", capacity)
			if capacity < uint64(len(buf)) {
				assert.Equal(t, byte('Z'), buf[capacity], "cap %d: written past the buffer", capacity)
			}
		}
		copy(buf, "ZZ")
		assert.Equal(t, n, mcbgo_metrics_text(b, nil, pointer(buf), 0), "cap 0")
		assert.Equal(t, "ZZ", string(buf[:2]), "cap 0 wrote the buffer")
		assert.Equal(t, n, mcbgo_metrics_text(b, nil, nil, 1<<20), "NULL buffer")
	})

	up := func(t *testing.T, text string) string {
		t.Helper()
		s := checkExposition(t, text)["mcbridge_up"]
		require.Len(t, s, 1)
		m := sampleRE.FindStringSubmatch(s[0])
		assert.Equal(t, "0", m[5], "%s", s[0])
		assert.Equal(t, "reason", m[3], "%s", s[0])
		return m[4]
	}
	t.Run("off reason", func(t *testing.T) {
		text := f.metricsText(t, b, ptr(f.c.cstr(t, "draft model")))
		assert.Contains(t, up(t, text), "draft model")
		assert.Contains(t, text, "\nmcbridge_lookups_total 2\n", "the bridge's counters, off or not")
		assert.Contains(t, f.metricsText(t, b, ptr(f.c.cstr(t, ""))), "\nmcbridge_up 1\n", "an empty reason is none")
		quoted := up(t, f.metricsText(t, b, ptr(f.c.cstr(t, "a \"draft\"\n\tmodel\\"))))
		assert.Contains(t, quoted, `a \"draft\" model\\`, "one line, escaped")
		long := up(t, f.metricsText(t, b, ptr(f.c.cstr(t, strings.Repeat("why ", 200)))))
		assert.Less(t, len(long), 300, "a reason is bounded")
		assert.NotEmpty(t, up(t, f.metricsText(t, b, pointer(edgeString(t, maxString, 'x')))), "an unterminated reason")
	})
	t.Run("no bridge", func(t *testing.T) {
		refused := f.out(t)
		f.expect(t, mcbgo_bridge_open(ptr(f.c.cstr(t, `{"pool_bytes":1}`)), unsafe.Pointer(refused), f.eb, f.el), status.Config, "open")
		why := f.lastError()
		text := f.metricsText(t, 0, nil)
		assert.Contains(t, up(t, text), strings.Fields(why)[len(strings.Fields(why))-1], "the refusal %q", why)
		assert.Contains(t, up(t, text), "pool_bytes")
		assert.Contains(t, text, "\nmcbridge_lookups_total 0\n")
		assert.Contains(t, up(t, f.metricsText(t, 0, ptr(f.c.cstr(t, "draft model")))), "draft model", "the host's reason first")
		other := f.open(t, f.config(""))
		assert.NotContains(t, up(t, f.metricsText(t, 0, nil)), "pool_bytes", "the refusal of an open that came before one that worked")
		f.expect(t, mcbgo_bridge_close(other, f.eb, f.el), status.OK, "close")
		assert.Contains(t, up(t, f.metricsText(t, other, nil)), "not an open bridge handle", "a closed bridge")
		assert.Contains(t, up(t, f.metricsText(t, m, nil)), "not an open bridge handle", "a model")
	})
}

// metrics_listen: the library serves the bridge's metrics on its own
// port from mcb_bridge_open to mcb_bridge_close; an open refused after
// the configuration parsed still serves why; an address that cannot be
// bound leaves the bridge without a listener (and says so on stderr).
func TestMetricsListen(t *testing.T) {
	f := newFixture(t)
	port := freePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	get := func() (string, error) {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	b := f.open(t, f.config(`,"metrics_listen":"`+addr+`"`))
	m := f.register(t, b, testModel(false).reg(t, f.c))
	f.peek(t, m, nil, prompt(31, 0, 31), 31)
	text, err := get()
	require.NoError(t, err)
	samples := checkExposition(t, text)
	assert.Equal(t, []string{"mcbridge_up 1"}, samples["mcbridge_up"])
	assert.Equal(t, []string{"mcbridge_lookups_total 1"}, samples["mcbridge_lookups_total"])
	f.expect(t, mcbgo_bridge_close(b, f.eb, f.el), status.OK, "close")
	_, err = get()
	assert.Error(t, err, "the listener outlived its bridge")

	out := f.out(t)
	bad := f.config(`,"metrics_listen":"` + addr + `","transport":{"kind":"mooncake","lib":"/no/such/libtransfer_engine.so"}`)
	f.must(t, mcbgo_bridge_open(ptr(f.c.cstr(t, bad)), unsafe.Pointer(out), f.eb, f.el), status.Config, "open")
	text, err = get()
	require.NoError(t, err, "a refused open still serves why")
	assert.Contains(t, text, "mcbridge_up{reason=")
	assert.Contains(t, text, "libtransfer_engine.so")

	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	other := f.open(t, f.config(`,"metrics_listen":"`+taken.Addr().String()+`"`))
	assert.NotZero(t, other, "a port another process holds costs the host its listener, not the bridge")
	f.expect(t, mcbgo_bridge_close(other, f.eb, f.el), status.OK, "close")
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
