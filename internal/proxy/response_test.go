package proxy

import (
	"bytes"
	"io"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSSESnifferPassesBytesAndReadsTheLastTimings(t *testing.T) {
	stream := "data: {\"content\":\"a\"}\n\n" +
		"data: {\"timings\":{\"cache_n\":1,\"prompt_n\":2}}\r\n\r\n" +
		": comment with \"timings\"\n" +
		"data: {\"choices\":[],\"timings\":{\"cache_n\":7,\"prompt_n\":9,\"prompt_ms\":2.5,\"predicted_n\":4}}\n\n" +
		"data: [DONE]\n\n"
	var closed *sseSniffer
	s := &sseSniffer{rc: io.NopCloser(iotest.OneByteReader(bytes.NewReader([]byte(stream)))), onClose: func(s *sseSniffer) { closed = s }}
	got, err := io.ReadAll(s)
	require.NoError(t, err)
	require.Equal(t, stream, string(got))
	require.NoError(t, s.Close())
	require.NotNil(t, closed, "close did not report")
	require.True(t, closed.seen, "sniffed nothing")
	require.True(t, closed.atEOF, "not at EOF")
	require.NotNil(t, closed.last.Timings)
	assert.Equal(t, timings{CacheN: 7, PromptN: 9, PromptMS: 2.5, PredictedN: 4}, *closed.last.Timings)
}

func TestSSESnifferSkipsOverlongLines(t *testing.T) {
	long := "data: {\"timings\":{\"cache_n\":1},\"x\":\"" + string(bytes.Repeat([]byte("x"), maxEventLine)) + "\"}\n"
	s := &sseSniffer{rc: io.NopCloser(bytes.NewReader([]byte(long + "data: {\"timings\":{\"cache_n\":2}}\n")))}
	_, err := io.Copy(io.Discard, s)
	require.NoError(t, err)
	require.True(t, s.seen, "sniffed nothing")
	assert.Equal(t, 2, s.last.Timings.CacheN, "sniffed %+v", s.last.Timings)
}
