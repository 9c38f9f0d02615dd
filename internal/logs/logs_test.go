package logs

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A message repeated on every request is written once an interval, with
// the count of what was suppressed; other messages are not held back.
func TestRateLimit(t *testing.T) {
	var out bytes.Buffer
	now := time.Unix(0, 0)
	log := New(&out, "info", func() time.Time { return now })
	for i := 0; i < 100; i++ {
		log.Warn("publishing failed", "i", i)
	}
	log.Warn("another failure")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2)
	assert.Contains(t, lines[0], "i=0")
	assert.Contains(t, lines[1], "another failure")

	now = now.Add(Interval)
	log.Warn("publishing failed", "i", 100)
	lines = strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 3)
	assert.Contains(t, lines[2], "suppressed=99")
}

func TestLevels(t *testing.T) {
	var out bytes.Buffer
	now := func() time.Time { return time.Unix(0, 0) }
	New(&out, "warn", now).Info("quiet")
	New(&out, "off", now).Error("silent")
	assert.Empty(t, out.String())
	New(&out, "debug", now).With("component", "x").Debug("loud")
	assert.Contains(t, out.String(), "component=x")
}
