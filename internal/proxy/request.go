package proxy

import (
	"bytes"
	"encoding/json"
	"math"

	"github.com/mcbridge/mcbridge/internal/status"
)

// endpoint is a route whose prompt the proxy can turn into tokens.
type endpoint int

const (
	completion endpoint = iota // /completion, /completions, /v1/completions: "prompt"
	chat                       // /chat/completions, /v1/chat/completions: "messages"
	infill                     // /infill: pinned to a slot, never restored
	responses                  // /responses, /v1/responses: OpenAI Responses, a chat to the server
	messages                   // /v1/messages: Anthropic Messages, sent as the chat the server converts it into
)

// request is what the proxy reads from a completion request. The body
// itself is forwarded with one change: the slot it is pinned to.
type request struct {
	ep     endpoint
	fields map[string]json.RawMessage

	stream      bool
	idSlot      int  // the client's choice, -1 for any
	cachePrompt bool // llama-server's default is true
	// dirty: the request changes KV in ways no key describes (per-request
	// LoRA, cache reuse by KV shifting): its slot must publish nothing.
	dirty bool
	// multi: the request runs several tasks (n_cmpl > 1): children take
	// slots the server picks.
	multi bool
	// prompt is the single prompt of a completion: a string, token ids, or
	// both mixed; nil when there is none the proxy can tokenize.
	prompt json.RawMessage
	tokens []int32 // set when the prompt is token ids only
	// predict is how many tokens the answer may generate, as the request
	// limits it (0: no limit given).
	predict int
	// asChat: a /v1/messages request whose fields are those of the chat
	// the server converts it into (anthropic.go); it goes to
	// messagesChatPath and its answer is written back in Anthropic's shape.
	asChat bool
}

// parseRequest reads a completion, chat or infill body. It fails on bodies
// llama-server would refuse too; shapes it accepts but the proxy cannot key
// (several prompts, multimodal objects) parse with a nil prompt.
func parseRequest(ep endpoint, body []byte) (*request, error) {
	r := &request{ep: ep, idSlot: -1, cachePrompt: true}
	if err := json.Unmarshal(body, &r.fields); err != nil || r.fields == nil {
		return nil, status.Errorf(status.InvalidArg, "request body is not a JSON object")
	}
	if v, ok := r.fields["stream"]; ok {
		_ = json.Unmarshal(v, &r.stream)
	}
	for _, name := range []string{"n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens"} {
		var n float64
		if v, ok := r.fields[name]; ok && json.Unmarshal(v, &n) == nil && n > 0 && r.predict == 0 {
			r.predict = int(min(n, math.MaxInt32))
		}
	}
	if ep == messages {
		// The server's conversion keeps only Anthropic's fields (no
		// id_slot, cache_prompt, lora or n_cache_reuse): the chat it makes
		// is read like any chat.
		chatBody, err := messagesToChat(body)
		if err != nil {
			return nil, err
		}
		r, err := parseRequest(chat, chatBody)
		if err != nil {
			return nil, err
		}
		r.ep, r.asChat = messages, true
		return r, nil
	}
	if v, ok := r.fields["cache_prompt"]; ok {
		_ = json.Unmarshal(v, &r.cachePrompt)
	}
	if v, ok := r.fields["id_slot"]; ok {
		var id float64
		if json.Unmarshal(v, &id) == nil && id >= 0 && id <= math.MaxInt32 && id == math.Trunc(id) {
			r.idSlot = int(id)
		}
	}
	for _, name := range []string{"n_cmpl", "n"} {
		var n float64
		if v, ok := r.fields[name]; ok && json.Unmarshal(v, &n) == nil && n > 1 {
			r.multi = true
		}
	}
	var reuse float64
	if v, ok := r.fields["n_cache_reuse"]; ok && json.Unmarshal(v, &reuse) == nil && reuse > 0 {
		r.dirty = true
	}
	if v, ok := r.fields["lora"]; ok {
		var l []json.RawMessage
		if json.Unmarshal(v, &l) != nil || len(l) > 0 {
			r.dirty = true
		}
	}
	if ep == completion {
		r.prompt, r.tokens = singlePrompt(r.fields["prompt"])
	}
	return r, nil
}

// singlePrompt applies llama-server's rules (tokenize_input_prompts): an
// array without numbers is a list of prompts, anything else one prompt.
// It returns the one prompt, and its tokens when it is token ids only.
func singlePrompt(p json.RawMessage) (json.RawMessage, []int32) {
	p = bytes.TrimSpace(p)
	if len(p) == 0 {
		return nil, nil
	}
	switch p[0] {
	case '"':
		return p, nil
	case '[':
	default:
		return nil, nil
	}
	var elems []json.RawMessage
	if json.Unmarshal(p, &elems) != nil || len(elems) == 0 {
		return nil, nil
	}
	numbers, strings := 0, 0
	for _, e := range elems {
		switch e = bytes.TrimSpace(e); {
		case len(e) > 0 && e[0] == '"':
			strings++
		case len(e) > 0 && (e[0] == '-' || (e[0] >= '0' && e[0] <= '9')):
			numbers++
		}
	}
	if numbers == 0 {
		if len(elems) == 1 {
			return singlePrompt(elems[0])
		}
		return nil, nil
	}
	if numbers+strings != len(elems) {
		return nil, nil
	}
	if strings > 0 {
		return p, nil
	}
	tokens := make([]int32, len(elems))
	for i, e := range elems {
		var f float64
		if json.Unmarshal(e, &f) != nil || f != math.Trunc(f) || f < math.MinInt32 || f > math.MaxInt32 {
			return nil, nil
		}
		tokens[i] = int32(f)
	}
	return p, tokens
}

// pinned is the body with id_slot set to slot (and, for a converted
// /v1/messages, the fields its answer is written back from).
func (r *request) pinned(slot int) ([]byte, error) {
	fields := make(map[string]json.RawMessage, len(r.fields)+3)
	for k, v := range r.fields {
		fields[k] = v
	}
	if r.asChat {
		for k, v := range messagesExtras(r.stream) {
			fields[k] = v
		}
	}
	id, _ := json.Marshal(slot)
	fields["id_slot"] = id
	// Without HTML escaping the prompt's bytes travel as the client wrote
	// them (the encoder would turn "<" into "\u003c": the same JSON string,
	// other bytes).
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(fields); err != nil {
		return nil, status.Wrap(status.InvalidArg, err, "re-encoding the request")
	}
	return b.Bytes(), nil
}
