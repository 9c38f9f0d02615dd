package proxy

import (
	"bytes"
	"encoding/json"
	"io"
)

// timings is what an answer says about its prompt: how many leading
// tokens the server reused (cache_n) and how many it computed (prompt_n),
// and what it generated. Native and OpenAI-compatible answers carry it as
// "timings", the last event of a stream too; Responses and Anthropic
// answers only as their usage counts, from which readAnswer fills it.
type timings struct {
	CacheN      int     `json:"cache_n"`
	PromptN     int     `json:"prompt_n"`
	PromptMS    float64 `json:"prompt_ms"`
	PredictedN  int     `json:"predicted_n"`
	PredictedMS float64 `json:"predicted_ms"`
}

type answer struct {
	Timings   *timings `json:"timings"`
	Truncated bool     `json:"truncated"`
}

// usage is the token counts of Responses ("input_tokens",
// "input_tokens_details.cached_tokens") and Anthropic answers
// ("input_tokens" beside "cache_read_input_tokens").
type usage struct {
	InputTokens  *int `json:"input_tokens"`
	OutputTokens *int `json:"output_tokens"`
	CacheRead    *int `json:"cache_read_input_tokens"`
	Details      *struct {
		Cached *int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

type usageHolder struct {
	Usage *usage `json:"usage"`
}

// readAnswer reads the prompt counts out of one JSON answer or stream
// event of ep; ok is false when it has none. An Anthropic stream spreads
// them over two events (message_start, message_delta): merge them.
func readAnswer(ep endpoint, b []byte) (answer, bool) {
	var raw struct {
		answer
		usageHolder
		Message  *usageHolder `json:"message"`  // Anthropic's message_start
		Response *usageHolder `json:"response"` // Responses' response.completed
	}
	if json.Unmarshal(b, &raw) != nil {
		return answer{}, false
	}
	if raw.Timings != nil {
		return raw.answer, true
	}
	u := raw.Usage
	for _, h := range []*usageHolder{raw.Message, raw.Response} {
		if u == nil && h != nil {
			u = h.Usage
		}
	}
	if u == nil {
		return answer{}, false
	}
	t := &timings{PromptN: -1}
	if u.OutputTokens != nil {
		t.PredictedN = *u.OutputTokens
	}
	switch {
	case ep == messages && u.InputTokens != nil && u.CacheRead != nil:
		t.CacheN, t.PromptN = *u.CacheRead, *u.InputTokens
	case ep == responses && u.InputTokens != nil && u.Details != nil && u.Details.Cached != nil:
		t.CacheN, t.PromptN = *u.Details.Cached, *u.InputTokens-*u.Details.Cached
	}
	return answer{Timings: t}, true
}

// merge adds a later event b to a: its prompt counts when it has them,
// and the larger generated count.
func (a *answer) merge(b answer) {
	if b.Timings == nil {
		return
	}
	if a.Timings == nil {
		t := *b.Timings
		a.Timings = &t
	} else {
		if b.Timings.PromptN >= 0 {
			a.Timings.CacheN, a.Timings.PromptN, a.Timings.PromptMS = b.Timings.CacheN, b.Timings.PromptN, b.Timings.PromptMS
		}
		a.Timings.PredictedN = max(a.Timings.PredictedN, b.Timings.PredictedN)
		a.Timings.PredictedMS = max(a.Timings.PredictedMS, b.Timings.PredictedMS)
	}
	a.Truncated = a.Truncated || b.Truncated
}

// prompted says whether the answer counted its prompt.
func (a *answer) prompted() bool { return a.Timings != nil && a.Timings.PromptN >= 0 }

// maxEventLine bounds the line an SSE sniffer keeps: longer events are
// passed on but not read (a final event with timings is a few hundred
// bytes).
const maxEventLine = 1 << 20

// sseSniffer passes a server-sent event stream through unchanged and reads
// the timings of its events as they go by.
type sseSniffer struct {
	rc      io.ReadCloser
	ep      endpoint
	line    []byte
	skip    bool // inside a line over maxEventLine
	last    answer
	seen    bool // an event with timings or usage went by
	atEOF   bool
	readErr bool // the upstream broke the stream off
	onClose func(s *sseSniffer)
}

func (s *sseSniffer) Read(p []byte) (int, error) {
	n, err := s.rc.Read(p)
	s.feed(p[:n])
	switch {
	case err == io.EOF:
		s.atEOF = true
	case err != nil:
		s.readErr = true
	}
	return n, err
}

func (s *sseSniffer) Close() error {
	err := s.rc.Close()
	if s.onClose != nil {
		s.onClose(s)
		s.onClose = nil
	}
	return err
}

func (s *sseSniffer) feed(b []byte) {
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			s.keep(b)
			return
		}
		s.keep(b[:i])
		if !s.skip {
			s.event(s.line)
		}
		s.line, s.skip = s.line[:0], false
		b = b[i+1:]
	}
}

func (s *sseSniffer) keep(b []byte) {
	if s.skip {
		return
	}
	if len(s.line)+len(b) > maxEventLine {
		s.skip = true
		return
	}
	s.line = append(s.line, b...)
}

func (s *sseSniffer) event(line []byte) {
	line = bytes.TrimSuffix(line, []byte("\r"))
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok || (!bytes.Contains(data, []byte(`"timings"`)) && !bytes.Contains(data, []byte(`"usage"`))) {
		return
	}
	if a, ok := readAnswer(s.ep, bytes.TrimSpace(data)); ok {
		s.last.merge(a)
		s.seen = true
	}
}
