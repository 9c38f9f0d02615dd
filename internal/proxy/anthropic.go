package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"strconv"

	"github.com/mcbridge/mcbridge/internal/status"
)

// llama-server v0.5.0 answers /v1/messages by converting the request into
// a chat completion (server_chat_convert_anthropic_to_oai), running it,
// and writing the result in Anthropic's shape. The conversion keeps only
// Anthropic's fields, so a slot id never reaches the server, which then
// picks the slot. The proxy therefore sends the converted chat itself to
// /v1/chat/completions, pinned to its slot like any chat, and writes the
// chat answer in the shape the server writes the same result in
// (tools/server/server-task.cpp: to_json_anthropic and
// to_json_anthropic_stream of the final result, to_json_anthropic of the
// partial ones), statement for statement, key order and number printing
// included. Two fields the chat answer lacks are asked for: "verbose"
// (its __verbose object holds the stop word, Anthropic's stop_sequence)
// and, streamed, "timings_per_token" (each partial result's counts, which
// message_start reports).

// messagesChatPath is where the proxy sends a converted /v1/messages.
const messagesChatPath = "/v1/chat/completions"

// messagesExtras are the fields added to a converted /v1/messages body
// besides its slot: they change what the chat answer says, not what is
// computed.
func messagesExtras(stream bool) map[string]json.RawMessage {
	extra := map[string]json.RawMessage{"verbose": json.RawMessage("true")}
	if stream {
		extra["timings_per_token"] = json.RawMessage("true")
	}
	return extra
}

// chatMessage is what a chat answer says of its message, as read back
// from the chat JSON (common_chat_msg::to_json_oaicompat).
type chatMessage struct {
	reasoning, content string
	calls              []toolCall
}

type toolCall struct{ id, name, arguments string }

// stopReason is Anthropic's stop_reason for a chat finish_reason: both are
// "stopped by EOS or a stop word, with or without tool calls", else the
// limit.
func stopReason(finish string) string {
	switch finish {
	case "stop":
		return "end_turn"
	case "tool_calls":
		return "tool_use"
	}
	return "max_tokens"
}

// stopSequence is the stop word of a __verbose object, null when none.
func stopSequence(verbose *object) any {
	if verbose != nil {
		if w := verbose.str("stopping_word"); w != "" {
			return w
		}
	}
	return nil
}

// toolInput is a tool call's arguments parsed as the server parses them
// (an empty object when they are not JSON).
func toolInput(arguments string) any {
	if v, err := parseOrdered([]byte(arguments)); err == nil {
		if _, err := dumpJSON(v); err == nil {
			return v
		}
	}
	return newObject()
}

// num reads a JSON number as an integer (0 when absent).
func num(v any) int64 {
	n, _ := v.(json.Number)
	i, _ := strconv.ParseInt(string(n), 10, 64)
	return i
}

// chatToMessages writes a non-streamed chat answer as the Anthropic answer
// the server writes for the same result (to_json_anthropic).
func chatToMessages(body []byte) ([]byte, error) {
	ans, err := parseObject(body)
	if err != nil {
		return nil, err
	}
	choices, _ := ans.get("choices").([]any)
	if len(choices) != 1 {
		return nil, status.Errorf(status.InvalidArg, "a chat answer with %d choices", len(choices))
	}
	choice, _ := choices[0].(*object)
	if choice == nil {
		return nil, status.Errorf(status.InvalidArg, "a chat answer's choice is not an object")
	}
	msg, _ := choice.get("message").(*object)
	if msg == nil {
		return nil, status.Errorf(status.InvalidArg, "a chat answer without a message")
	}
	m := chatMessage{reasoning: msg.str("reasoning_content"), content: msg.str("content")}
	calls, _ := msg.get("tool_calls").([]any)
	for _, c := range calls {
		call, _ := c.(*object)
		if call == nil {
			continue
		}
		fn, _ := call.get("function").(*object)
		if fn == nil {
			fn = newObject()
		}
		m.calls = append(m.calls, toolCall{id: call.str("id"), name: fn.str("name"), arguments: fn.str("arguments")})
	}
	blocks := []any{}
	if m.reasoning != "" {
		blocks = append(blocks, newObject("type", "thinking", "thinking", m.reasoning, "signature", ""))
	}
	if m.content != "" {
		blocks = append(blocks, newObject("type", "text", "text", m.content))
	}
	for _, c := range m.calls {
		blocks = append(blocks, newObject("type", "tool_use", "id", c.id, "name", c.name, "input", toolInput(c.arguments)))
	}
	u, _ := ans.get("usage").(*object)
	if u == nil {
		return nil, status.Errorf(status.InvalidArg, "a chat answer without usage")
	}
	details, _ := u.get("prompt_tokens_details").(*object)
	if details == nil {
		details = newObject()
	}
	cached := num(details.get("cached_tokens"))
	verbose, _ := ans.get("__verbose").(*object)
	out := newObject(
		"id", ans.get("id"),
		"type", "message",
		"role", "assistant",
		"content", blocks,
		"model", ans.get("model"),
		"stop_reason", stopReason(choice.str("finish_reason")),
		"stop_sequence", stopSequence(verbose),
		"usage", newObject(
			"cache_read_input_tokens", jsonInt64(cached),
			"input_tokens", jsonInt64(num(u.get("prompt_tokens"))-cached),
			"output_tokens", jsonInt64(num(u.get("completion_tokens"))),
		),
	)
	s, err := dumpJSON(out)
	return []byte(s), err
}

func jsonInt64(n int64) json.Number { return json.Number(strconv.FormatInt(n, 10)) }

// messagesStream reads a streamed chat answer and writes the Anthropic
// events the server writes for the same results. The chat stream shows
// where each result ends: with timings_per_token every partial result's
// last chunk carries "timings", and the final result's first chunk
// carries "__verbose" and its last one the finish_reason.
type messagesStream struct {
	rc  io.ReadCloser
	in  *bufio.Reader
	out bytes.Buffer
	err error

	group   []*object // the chunks of the result being read
	final   bool      // the group is the final result's
	started struct{ thinking, text bool }
	msg     chatMessage // the message so far
	model   any
	id      any
}

func newMessagesStream(rc io.ReadCloser) *messagesStream {
	return &messagesStream{rc: rc, in: bufio.NewReaderSize(rc, 64<<10)}
}

func (s *messagesStream) Read(p []byte) (int, error) {
	for s.out.Len() == 0 && s.err == nil {
		s.err = s.step()
	}
	if s.out.Len() > 0 {
		return s.out.Read(p)
	}
	return 0, s.err
}

func (s *messagesStream) Close() error { return s.rc.Close() }

// step reads one line of the chat stream.
func (s *messagesStream) step() error {
	line, err := s.in.ReadBytes('\n')
	if err != nil && (err != io.EOF || len(line) == 0) {
		return err
	}
	line = bytes.TrimRight(line, "\r\n")
	switch {
	case len(line) == 0:
		return nil
	case line[0] == ':':
		// The server's keep-alive ping, the same in both shapes.
		s.out.Write(line)
		s.out.WriteString("\n\n")
		return nil
	}
	data, ok := bytes.CutPrefix(line, []byte("data: "))
	if !ok || string(data) == "[DONE]" {
		// The chat stream's end: Anthropic's has no marker.
		return nil
	}
	chunk, err := parseObject(data)
	if err != nil {
		return status.Wrap(status.InvalidArg, err, "reading the chat stream")
	}
	if chunk.has("error") && !chunk.has("choices") {
		// The server's error event after the stream began.
		return s.event("error", chunk.get("error"))
	}
	return s.chunk(chunk)
}

// chunk adds a chunk to its result, and writes the result's events when
// it is complete.
func (s *messagesStream) chunk(c *object) error {
	if s.id == nil {
		s.id, s.model = c.get("id"), c.get("model")
	}
	if c.has("__verbose") {
		s.final = true
	}
	s.group = append(s.group, c)
	choice := firstChoice(c)
	switch {
	case choice != nil && choice.get("finish_reason") != nil:
		return s.finalEvents()
	case !s.final && c.has("timings"):
		return s.partialEvents()
	}
	return nil
}

func firstChoice(c *object) *object {
	choices, _ := c.get("choices").([]any)
	if len(choices) == 0 {
		return nil
	}
	ch, _ := choices[0].(*object)
	return ch
}

// diff is one chunk's delta as the result's diff it was written from.
type diff struct {
	role      bool // the first token's opening delta, no diff
	reasoning string
	content   string
	call      int // -1: none
	id, name  string
	arguments string
}

func deltaOf(c *object) diff {
	d := diff{call: -1}
	ch := firstChoice(c)
	if ch == nil {
		return d
	}
	delta, _ := ch.get("delta").(*object)
	if delta == nil {
		return d
	}
	d.role = delta.has("role")
	d.reasoning, d.content = delta.str("reasoning_content"), delta.str("content")
	if calls, _ := delta.get("tool_calls").([]any); len(calls) > 0 {
		call, _ := calls[0].(*object)
		if call != nil {
			d.call = int(num(call.get("index")))
			d.id = call.str("id")
			if fn, _ := call.get("function").(*object); fn != nil {
				d.name, d.arguments = fn.str("name"), fn.str("arguments")
			}
		}
	}
	return d
}

// apply adds a diff to the message so far.
func (m *chatMessage) apply(d diff) {
	m.reasoning += d.reasoning
	m.content += d.content
	if d.call < 0 {
		return
	}
	for len(m.calls) <= d.call {
		m.calls = append(m.calls, toolCall{})
	}
	c := &m.calls[d.call]
	if d.id != "" || d.name != "" {
		c.id, c.name = d.id, d.name
	}
	c.arguments += d.arguments
}

func (s *messagesStream) event(name string, data any) error {
	b, err := dumpJSON(data)
	if err != nil {
		return err
	}
	s.out.WriteString("event: " + name + "\ndata: " + b + "\n\n")
	return nil
}

func blockStart(index int, block *object) *object {
	return newObject("type", "content_block_start", "index", jsonInt(index), "content_block", block)
}

func blockDelta(index int, delta *object) *object {
	return newObject("type", "content_block_delta", "index", jsonInt(index), "delta", delta)
}

// partialEvents writes a partial result's events
// (server_task_result_cmpl_partial::to_json_anthropic).
func (s *messagesStream) partialEvents() error {
	group := s.group
	s.group = nil
	diffs := make([]diff, len(group))
	for i, c := range group {
		diffs[i] = deltaOf(c)
		s.msg.apply(diffs[i])
	}
	var evs []*object
	if len(diffs) > 0 && diffs[0].role {
		// The first token's result (n_decoded == 1): its counts are the
		// prompt's, in the timings of its last chunk.
		t, _ := group[len(group)-1].get("timings").(*object)
		if t == nil {
			t = newObject()
		}
		cached := num(t.get("cache_n"))
		evs = append(evs, newObject("type", "message_start", "message", newObject(
			"id", s.id, "type", "message", "role", "assistant", "content", []any{}, "model", s.model,
			"stop_reason", nil, "stop_sequence", nil,
			"usage", newObject("cache_read_input_tokens", jsonInt64(cached), "input_tokens", jsonInt64(num(t.get("prompt_n"))),
				"output_tokens", jsonInt(0)))))
	}
	hasReasoning := s.msg.reasoning != ""
	textIndex := 0
	if hasReasoning {
		textIndex = 1
	}
	for _, d := range diffs {
		if d.role {
			continue
		}
		if d.reasoning != "" {
			if !s.started.thinking {
				evs = append(evs, blockStart(0, newObject("type", "thinking", "thinking", "")))
				s.started.thinking = true
			}
			evs = append(evs, blockDelta(0, newObject("type", "thinking_delta", "thinking", d.reasoning)))
		}
		if d.content != "" {
			if !s.started.text {
				evs = append(evs, blockStart(textIndex, newObject("type", "text", "text", "")))
				s.started.text = true
			}
			evs = append(evs, blockDelta(textIndex, newObject("type", "text_delta", "text", d.content)))
		}
		if d.call >= 0 {
			index := d.call
			if hasReasoning {
				index++
			}
			if s.started.text {
				index++
			}
			if d.name != "" {
				evs = append(evs, blockStart(index, newObject("type", "tool_use", "id", d.id, "name", d.name)))
			}
			if d.arguments != "" {
				evs = append(evs, blockDelta(index, newObject("type", "input_json_delta", "partial_json", d.arguments)))
			}
		}
	}
	return s.write(evs)
}

func (s *messagesStream) write(evs []*object) error {
	for _, ev := range evs {
		if err := s.event(ev.str("type"), ev); err != nil {
			return err
		}
	}
	return nil
}

// finalEvents writes the final result's events
// (server_task_result_cmpl_final::to_json_anthropic_stream): its own
// diffs, counted as if no block had started, then every block closed.
func (s *messagesStream) finalEvents() error {
	group := s.group
	s.group, s.final = nil, false
	last := group[len(group)-1]
	finish := firstChoice(last).str("finish_reason")
	var verbose *object
	var diffs []diff
	for _, c := range group {
		if v, ok := c.get("__verbose").(*object); ok {
			verbose = v
		}
		if c == last {
			break
		}
		d := deltaOf(c)
		diffs = append(diffs, d)
		s.msg.apply(d)
	}
	t, _ := last.get("timings").(*object)
	if t == nil {
		t = newObject()
	}
	m := s.msg
	hasThinking, hasText := m.reasoning != "", m.content != ""
	textIndex, toolBase := 0, 0
	if hasThinking {
		textIndex, toolBase = 1, 1
	}
	if hasText {
		toolBase++
	}
	var evs []*object
	var thinkingStarted, textStarted bool
	callStarted := map[int]bool{}
	for _, d := range diffs {
		if d.reasoning != "" {
			if !thinkingStarted {
				evs = append(evs, blockStart(0, newObject("type", "thinking", "thinking", "")))
				thinkingStarted = true
			}
			evs = append(evs, blockDelta(0, newObject("type", "thinking_delta", "thinking", d.reasoning)))
		}
		if d.content != "" {
			if !textStarted {
				evs = append(evs, blockStart(textIndex, newObject("type", "text", "text", "")))
				textStarted = true
			}
			evs = append(evs, blockDelta(textIndex, newObject("type", "text_delta", "text", d.content)))
		}
		if d.call >= 0 && d.call < len(m.calls) {
			index := toolBase + d.call
			if !callStarted[d.call] {
				full := m.calls[d.call]
				evs = append(evs, blockStart(index, newObject("type", "tool_use", "id", full.id, "name", full.name)))
				callStarted[d.call] = true
			}
			if d.arguments != "" {
				evs = append(evs, blockDelta(index, newObject("type", "input_json_delta", "partial_json", d.arguments)))
			}
		}
	}
	if hasThinking {
		evs = append(evs, blockDelta(0, newObject("type", "signature_delta", "signature", "")),
			newObject("type", "content_block_stop", "index", jsonInt(0)))
	}
	if hasText {
		evs = append(evs, newObject("type", "content_block_stop", "index", jsonInt(textIndex)))
	}
	for i := range m.calls {
		evs = append(evs, newObject("type", "content_block_stop", "index", jsonInt(toolBase+i)))
	}
	evs = append(evs,
		newObject("type", "message_delta",
			"delta", newObject("stop_reason", stopReason(finish), "stop_sequence", stopSequence(verbose)),
			"usage", newObject("output_tokens", jsonInt64(num(t.get("predicted_n"))))),
		newObject("type", "message_stop"))
	return s.write(evs)
}
