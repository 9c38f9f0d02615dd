package metrics

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/status"
)

// docs/metrics.md documents exactly the vocabularies: every series, its
// type, label and help, in order.
func TestDocumentedOnce(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "metrics.md"))
	require.NoError(t, err)
	for prefix, vocabulary := range map[string][]Series{Prefix: Vocabulary, ProxyPrefix: ProxyVocabulary} {
		row := regexp.MustCompile("^\\| `" + prefix + "([a-z_]+)` \\| ([a-z]+) \\| ([a-z]*) \\| (.*) \\|$")
		var doc []string
		for _, line := range strings.Split(string(b), "\n") {
			if m := row.FindStringSubmatch(line); m != nil {
				doc = append(doc, strings.Join(m[1:], " | "))
			}
		}
		var code []string
		for _, s := range vocabulary {
			code = append(code, strings.Join([]string{s.Name, s.Kind, s.Label, s.Help}, " | "))
		}
		assert.Equal(t, code, doc, prefix)
	}
}

func TestWriteProxy(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, WriteProxy(&out, func(name string) []Sample {
		switch name {
		case "requests_total":
			return []Sample{{Value: 3}}
		case "upstream_up":
			return []Sample{{Label: "http://a:1", Value: 1}, {Label: "http://b:2", Value: 0}}
		}
		return nil
	}))
	text := out.String()
	assert.Contains(t, text, "\nmcproxy_requests_total 3\n")
	assert.Contains(t, text, "mcproxy_upstream_up{upstream=\"http://a:1\"} 1\nmcproxy_upstream_up{upstream=\"http://b:2\"} 0\n")
	for _, s := range ProxyVocabulary {
		assert.Contains(t, text, "# HELP mcproxy_"+s.Name+" "+s.Help+"\n# TYPE mcproxy_"+s.Name+" "+s.Kind+"\n")
	}
}

func TestWrite(t *testing.T) {
	c := config.Default()
	c.PoolBytes = 4 << 20
	c.Directory.Name = t.Name()
	b, err := bridge.Open(c, bridge.Deps{})
	require.NoError(t, err)
	defer b.Close()
	var up, off, none bytes.Buffer
	require.NoError(t, Write(&up, b, nil))
	require.NoError(t, Write(&off, b, status.Errorf(status.Unsupported, "a draft model\nis in use")))
	require.NoError(t, Write(&none, nil, status.Errorf(status.Config, `config: unknown field "x"`)))
	assert.Contains(t, up.String(), "\nmcbridge_up 1\n")
	assert.Contains(t, up.String(), "\nmcbridge_pool_bytes 4194304\n")
	assert.Contains(t, off.String(), `mcbridge_up{reason="unsupported: a draft model is in use"} 0`)
	assert.Contains(t, none.String(), `mcbridge_up{reason="bad configuration: config: unknown field \"x\""} 0`)
	for _, s := range Vocabulary {
		for _, text := range []string{up.String(), none.String()} {
			assert.Contains(t, text, "# HELP mcbridge_"+s.Name+" ", "every series is described, the bridge on or off")
		}
	}
}

func TestListener(t *testing.T) {
	c := config.Default()
	c.PoolBytes = 4 << 20
	c.Directory.Name = t.Name()
	b, err := bridge.Open(c, bridge.Deps{})
	require.NoError(t, err)
	defer b.Close()
	l, err := Listen("127.0.0.1:0", b, nil)
	require.NoError(t, err)
	get := func() string {
		resp, err := http.Get("http://" + l.Addr() + "/metrics")
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(body)
	}
	assert.Contains(t, get(), "\nmcbridge_up 1\n")
	l.Set(nil, status.Errorf(status.Config, "refused"))
	assert.Contains(t, get(), `mcbridge_up{reason="bad configuration: refused"} 0`)
	_, err = Listen(l.Addr(), b, nil)
	assert.Equal(t, status.Config, status.Of(err), "the address is taken: %v", err)
	require.NoError(t, l.Close())
	_, err = http.Get("http://" + l.Addr() + "/metrics")
	assert.Error(t, err, "closed")
}
