package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"strconv"
)

// timings is what a completion's answer says about its prompt: how many
// leading tokens the server reused (cache_n) and how long the rest took.
// Both the native and the OpenAI-compatible answers carry it, the last
// event of a stream too.
type timings struct {
	CacheN     int     `json:"cache_n"`
	PromptN    int     `json:"prompt_n"`
	PromptMS   float64 `json:"prompt_ms"`
	PredictedN int     `json:"predicted_n"`
}

type answer struct {
	Timings   *timings `json:"timings"`
	Truncated bool     `json:"truncated"`
}

// readAnswer reads the timings out of one JSON answer or stream event;
// ok is false when it has none.
func readAnswer(b []byte) (answer, bool) {
	var a answer
	if json.Unmarshal(b, &a) != nil || a.Timings == nil {
		return answer{}, false
	}
	return a, true
}

// spliceTimings adds members (`"k":v,...`) to the "timings" object of a
// JSON object, or a "timings" object holding them when there is none.
// Every other byte of body stays as it was. ok is false, and body is
// returned unchanged, when body is not one JSON object or its "timings"
// is not an object.
func spliceTimings(body []byte, members string) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return body, false
	}
	empty := true
	insertAt, objEmpty := -1, false
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return body, false
		}
		empty = false
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return body, false
		}
		if k == "timings" {
			if len(raw) == 0 || raw[0] != '{' {
				return body, false
			}
			// The value ends at the decoder's offset; its last byte is
			// the object's closing brace.
			insertAt = int(dec.InputOffset()) - 1
			objEmpty = isEmptyObject(raw)
		}
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return body, false
	}
	end := int(dec.InputOffset()) - 1
	if _, err := dec.Token(); err != io.EOF {
		return body, false
	}
	var add string
	switch {
	case insertAt >= 0 && objEmpty:
		add = members
	case insertAt >= 0:
		add = "," + members
	case empty:
		insertAt, add = end, `"timings":{`+members+`}`
	default:
		insertAt, add = end, `,"timings":{`+members+`}`
	}
	out := make([]byte, 0, len(body)+len(add))
	out = append(out, body[:insertAt]...)
	out = append(out, add...)
	return append(out, body[insertAt:]...), true
}

func isEmptyObject(raw json.RawMessage) bool {
	var m map[string]json.RawMessage
	return json.Unmarshal(raw, &m) == nil && len(m) == 0
}

// mcbMembers are the fields the proxy adds to an answer's timings.
func mcbMembers(restored int, restoreMS float64) string {
	return `"mcb_restored_n":` + strconv.Itoa(restored) + `,"mcb_restore_ms":` + strconv.FormatFloat(restoreMS, 'f', 3, 64)
}

// maxEventLine bounds the line an SSE sniffer keeps: longer events are
// passed on but not read (a final event with timings is a few hundred
// bytes).
const maxEventLine = 1 << 20

// sseSniffer passes a server-sent event stream through unchanged and reads
// the timings of its events as they go by.
type sseSniffer struct {
	rc      io.ReadCloser
	line    []byte
	skip    bool // inside a line over maxEventLine
	last    answer
	seen    bool // an event with timings went by
	atEOF   bool
	onClose func(s *sseSniffer)
}

func (s *sseSniffer) Read(p []byte) (int, error) {
	n, err := s.rc.Read(p)
	s.feed(p[:n])
	if err == io.EOF {
		s.atEOF = true
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
	if !ok || !bytes.Contains(data, []byte(`"timings"`)) {
		return
	}
	if a, ok := readAnswer(bytes.TrimSpace(data)); ok {
		s.last, s.seen = a, true
	}
}
