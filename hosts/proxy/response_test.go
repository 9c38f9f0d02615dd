package proxy

import (
	"bytes"
	"io"
	"testing"
	"testing/iotest"
)

func TestSpliceTimings(t *testing.T) {
	const m = `"mcb_restored_n":5,"mcb_restore_ms":1.250`
	tests := []struct {
		name, in, want string
		ok             bool
	}{
		{"into timings", `{"a":1,"timings":{"cache_n":3},"b":[{}]}`, `{"a":1,"timings":{"cache_n":3,` + m + `},"b":[{}]}`, true},
		{"into empty timings", `{"timings":{}}`, `{"timings":{` + m + `}}`, true},
		{"into spaced empty timings", `{"timings":{ } }`, `{"timings":{ ` + m + `} }`, true},
		{"no timings", `{"a":"}"}`, `{"a":"}","timings":{` + m + `}}`, true},
		{"empty object", `{}`, `{"timings":{` + m + `}}`, true},
		{"timings not an object", `{"timings":null}`, `{"timings":null}`, false},
		{"whitespace kept", "{ \"timings\" : {\"x\": 1}\n}\n", "{ \"timings\" : {\"x\": 1," + m + "}\n}\n", true},
		{"nested timings untouched", `{"x":{"timings":{}}}`, `{"x":{"timings":{}},"timings":{` + m + `}}`, true},
		{"array", `[1]`, `[1]`, false},
		{"two objects", `{}{}`, `{}{}`, false},
		{"broken", `{"a":`, `{"a":`, false},
		{"empty", ``, ``, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := spliceTimings([]byte(tc.in), mcbMembers(5, 1.25))
			if ok != tc.ok || string(got) != tc.want {
				t.Fatalf("got %s (%v), want %s (%v)", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestSSESnifferPassesBytesAndReadsTheLastTimings(t *testing.T) {
	stream := "data: {\"content\":\"a\"}\n\n" +
		"data: {\"timings\":{\"cache_n\":1,\"prompt_n\":2}}\r\n\r\n" +
		": comment with \"timings\"\n" +
		"data: {\"choices\":[],\"timings\":{\"cache_n\":7,\"prompt_n\":9,\"prompt_ms\":2.5,\"predicted_n\":4}}\n\n" +
		"data: [DONE]\n\n"
	var closed *sseSniffer
	s := &sseSniffer{rc: io.NopCloser(iotest.OneByteReader(bytes.NewReader([]byte(stream)))), onClose: func(s *sseSniffer) { closed = s }}
	got, err := io.ReadAll(s)
	if err != nil || string(got) != stream {
		t.Fatalf("passed %q, %v", got, err)
	}
	if err := s.Close(); err != nil || closed == nil {
		t.Fatal("close did not report")
	}
	want := timings{CacheN: 7, PromptN: 9, PromptMS: 2.5, PredictedN: 4}
	if !closed.seen || !closed.atEOF || *closed.last.Timings != want {
		t.Fatalf("sniffed %+v seen %v eof %v", closed.last.Timings, closed.seen, closed.atEOF)
	}
}

func TestSSESnifferSkipsOverlongLines(t *testing.T) {
	long := "data: {\"timings\":{\"cache_n\":1},\"x\":\"" + string(bytes.Repeat([]byte("x"), maxEventLine)) + "\"}\n"
	s := &sseSniffer{rc: io.NopCloser(bytes.NewReader([]byte(long + "data: {\"timings\":{\"cache_n\":2}}\n")))}
	if _, err := io.Copy(io.Discard, s); err != nil {
		t.Fatal(err)
	}
	if !s.seen || s.last.Timings.CacheN != 2 {
		t.Fatalf("sniffed %+v", s.last.Timings)
	}
}
