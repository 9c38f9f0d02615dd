package proxy

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/mcbridge/mcbridge/internal/gguf"
	"github.com/mcbridge/mcbridge/internal/host"
	"github.com/mcbridge/mcbridge/internal/llamastate"
)

// fakeServer answers like llama-server v0.5.0 where the proxy looks: slots,
// slot files, completions, tokenizer and chat template. Its KV is a hash
// of the model seed, layer and token prefix, laid out in slot files in the
// format of a real one from llamastate's testdata, cells out of position
// order as a real cache may have them. A restore checks every byte of K
// and V against what the server would compute: a proxy that restores
// anything else fails the test.
type fakeServer struct {
	t      testing.TB
	srv    *httptest.Server
	dir    string // the slot directory, with a trailing slash as servers are given it
	model  string // the model file /props names
	seed   uint64
	format kvFormat
	nCtx   int

	mu    sync.Mutex
	slots []fakeSlot
	tasks int
	build string

	// knobs the tests turn
	refuseRestore  bool
	saveVersion    uint32           // when set, saved files claim this version
	completionCode int              // when set, completions fail with it
	gate           chan struct{}    // when set, each stream event after the first waits for it
	busy           map[int]bool     // slots /slots reports busy
	restores       []int            // slots restored into, in order
	overlaps       int              // pinned requests that found their slot computing
	requests       []map[string]any // completion bodies as received
	apiKey         string           // when set, every call but /health must carry it
	tokenShift     int              // /tokenize adds this many tokens completions do not compute
	// recurrent: a hybrid memory, whose slot files carry the recurrent
	// state of their end after the KV cache (newHybridFake).
	recurrent bool
}

type fakeSlot struct {
	tokens    []int32
	computing bool
	task      *int
}

// newFake starts a fake server with n slots whose KV format is the one of
// the testdata slot file (n streams when streams > 1).
func newFake(t testing.TB, file string, slots, streams int, seed uint64) *fakeServer {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "internal", "llamastate", "testdata", file))
	require.NoError(t, err)
	st, err := llamastate.Parse(b)
	require.NoError(t, err)
	f, _, err := formatOf(st)
	require.NoError(t, err)
	f.NStream = streams
	dir := t.TempDir()
	model := filepath.Join(dir, "model.gguf")
	// A real GGUF: the fingerprint reads its architecture and digests it.
	cfg := gguf.Presets["tiny"]
	cfg.Seed = seed
	require.NoError(t, gguf.WriteFile(model, cfg))
	slotDir := filepath.Join(dir, "slots")
	require.NoError(t, os.Mkdir(slotDir, 0o755))
	fs := &fakeServer{t: t, dir: slotDir + "/", model: model, seed: seed, format: f, nCtx: 4096,
		slots: make([]fakeSlot, slots), busy: map[int]bool{}, build: "b1-fake"}
	fs.srv = httptest.NewServer(fs.handler())
	t.Cleanup(fs.srv.Close)
	return fs
}

// newHybridFake is newFake of a hybrid memory (a Qwen3.5's): its model file
// names a hybrid architecture, and its slot files end with a recurrent
// state that depends on every token the slot holds.
func newHybridFake(t testing.TB, file string, slots int, seed uint64) *fakeServer {
	t.Helper()
	fs := newFake(t, file, slots, 1, seed)
	kvs := []gguf.KV{{Key: "general.architecture", Value: gguf.String("qwen35")}}
	require.NoError(t, gguf.WriteModelFile(fs.model, kvs, []gguf.TensorSpec{{Name: "output_norm.weight", Shape: []uint64{8}, Init: gguf.Ones}}, seed))
	fs.recurrent = true
	return fs
}

// recurrentState is the recurrent state after tokens.
func (fs *fakeServer) recurrentState(tokens []int32) []byte {
	h := fs.seed
	if hs := fs.prefixHashes(tokens); len(hs) > 0 {
		h = hs[len(hs)-1]
	}
	return fs.row(h, 0, 'r', 40)
}

func (fs *fakeServer) url() string { return fs.srv.URL }

// kvFormat is the fake's KV cache: the rows of a real one, and its stream
// count (one per slot, or one shared).
type kvFormat struct {
	host.Format
	NStream int
}

func formatOf(st *llamastate.State) (kvFormat, int, error) {
	f, si, err := host.FormatOf(st)
	return kvFormat{Format: f, NStream: len(st.Streams)}, si, err
}

// row is the K or V row of layer l at position p after prefix hash h.
func (fs *fakeServer) row(h uint64, l int, kind byte, size int) []byte {
	out := make([]byte, size)
	var seed [18]byte
	binary.LittleEndian.PutUint64(seed[:], h)
	seed[8], seed[9] = byte(l), kind
	for i := 0; i < size; i += 8 {
		binary.LittleEndian.PutUint64(seed[10:], uint64(i))
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], xxh3.Hash(seed[:]))
		copy(out[i:], w[:])
	}
	return out
}

// prefixHashes are the chained hashes the KV of each position depends on.
func (fs *fakeServer) prefixHashes(tokens []int32) []uint64 {
	hs := make([]uint64, len(tokens))
	h := fs.seed
	var b [12]byte
	for i, t := range tokens {
		binary.LittleEndian.PutUint64(b[:], h)
		binary.LittleEndian.PutUint32(b[8:], uint32(t))
		h = xxh3.Hash(b[:])
		hs[i] = h
	}
	return hs
}

// cellPos is the position cell c of n holds: a rotation, so that the
// files are not in position order.
func cellPos(c, n int) int { return (c + n/3) % n }

// slotFile writes what the server holds in slot id as a slot file.
func (fs *fakeServer) slotFile(id int, tokens []int32) []byte {
	n := len(tokens)
	f := fs.format
	st := &llamastate.State{Kind: llamastate.SlotFile, Words: host.ServerWords(tokens), Streams: make([]llamastate.Stream, f.NStream)}
	if n == 0 {
		b, err := st.Build()
		assert.NoError(fs.t, err)
		return b
	}
	stream := 0
	if f.NStream > 1 {
		stream = id
	}
	s := &st.Streams[stream]
	s.VTrans = f.VTrans
	hs := fs.prefixHashes(tokens)
	for c := 0; c < n; c++ {
		s.Cells = append(s.Cells, llamastate.Cell{Pos: int32(cellPos(c, n)), SeqIDs: []int32{int32(id)}})
	}
	for l, lf := range f.Layers {
		ly := llamastate.Layer{KType: lf.KType, KRowSize: lf.KRow, VType: lf.VType, VRowSize: lf.VRow, VElSize: lf.VElSize, NEmbdV: lf.NEmbdV}
		for c := 0; c < n; c++ {
			ly.K = append(ly.K, fs.row(hs[cellPos(c, n)], l, 'k', int(lf.KRow))...)
		}
		ly.V = make([]byte, n*int(lf.VRow))
		for c := 0; c < n; c++ {
			v := fs.row(hs[cellPos(c, n)], l, 'v', int(lf.VRow))
			if !f.VTrans {
				copy(ly.V[c*int(lf.VRow):], v)
				continue
			}
			el := int(lf.VElSize)
			for j := 0; j < int(lf.NEmbdV); j++ {
				copy(ly.V[(j*n+c)*el:(j*n+c+1)*el], v[j*el:])
			}
		}
		s.Layers = append(s.Layers, ly)
	}
	b, err := st.Build()
	assert.NoError(fs.t, err)
	if fs.recurrent {
		b = append(b, fs.recurrentState(tokens)...)
	}
	if fs.saveVersion != 0 {
		binary.LittleEndian.PutUint32(b[4:], fs.saveVersion)
	}
	return b
}

// load checks a slot file byte by byte against what this server computes
// for its tokens, as llama.cpp's restore checks the format (the content
// check is the test's own: wrong KV must never reach a slot).
func (fs *fakeServer) load(b []byte) ([]int32, error) {
	var st *llamastate.State
	var err error
	if fs.recurrent {
		var rest int
		if st, rest, err = llamastate.ParseLeading(b); err != nil {
			return nil, err
		}
		toks, err := st.PromptTokens()
		if err != nil {
			return nil, err
		}
		if !assert.Equal(fs.t, fs.recurrentState(toks), b[len(b)-rest:], "restore: the recurrent state is not the one after the restored tokens") {
			return nil, fmt.Errorf("wrong recurrent state")
		}
	} else if st, err = llamastate.Parse(b); err != nil {
		return nil, err
	}
	toks, err := st.PromptTokens()
	if err != nil {
		return nil, err
	}
	f, si, err := formatOf(st)
	if err != nil {
		return nil, err
	}
	if !f.Equal(&fs.format.Format) {
		return nil, fmt.Errorf("format differs")
	}
	s := &st.Streams[si]
	n := len(s.Cells)
	if n != len(toks) {
		return nil, fmt.Errorf("%d cells for %d tokens", n, len(toks))
	}
	hs := fs.prefixHashes(toks)
	for c, cell := range s.Cells {
		p := int(cell.Pos)
		for l, ly := range s.Layers {
			if !assert.Equal(fs.t, fs.row(hs[p], l, 'k', int(ly.KRowSize)), ly.K[c*int(ly.KRowSize):(c+1)*int(ly.KRowSize)],
				"restore: layer %d K of position %d is not this model's", l, p) {
				return nil, fmt.Errorf("wrong K")
			}
			want := fs.row(hs[p], l, 'v', int(ly.VRowSize))
			got := make([]byte, ly.VRowSize)
			if !s.VTrans {
				copy(got, ly.V[c*int(ly.VRowSize):])
			} else {
				el := int(ly.VElSize)
				for j := 0; j < int(ly.NEmbdV); j++ {
					copy(got[j*el:(j+1)*el], ly.V[(j*n+c)*el:])
				}
			}
			if !assert.Equal(fs.t, want, got, "restore: layer %d V of position %d is not this model's", l, p) {
				return nil, fmt.Errorf("wrong V")
			}
		}
	}
	return toks, nil
}

// answerTokens is what the model generates after prompt: it depends on
// the prompt only, as greedy decoding over the same KV does.
func (fs *fakeServer) answerTokens(prompt []int32, n int) []int32 {
	hs := fs.prefixHashes(prompt)
	h := fs.seed
	if len(hs) > 0 {
		h = hs[len(hs)-1]
	}
	out := make([]int32, n)
	for i := range out {
		h = xxh3.Hash([]byte(strconv.FormatUint(h, 16)))
		out[i] = int32(256 + h%256)
	}
	return out
}

func fakeError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	fmt.Fprintf(w, `{"error":{"code":%d,"message":%q,"type":"invalid_request_error"}}`, code, msg)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	_ = json.NewEncoder(w).Encode(v)
}

// tokenize is the fake's byte-level tokenizer: strings are their bytes,
// numbers are token ids.
func tokenize(v any) []int32 {
	switch v := v.(type) {
	case string:
		out := make([]int32, len(v))
		for i := 0; i < len(v); i++ {
			out[i] = int32(v[i])
		}
		return out
	case []any:
		var out []int32
		for _, e := range v {
			if f, ok := e.(float64); ok {
				out = append(out, int32(f))
			} else {
				out = append(out, tokenize(e)...)
			}
		}
		return out
	}
	return nil
}

// chatPrompt is the fake's chat template.
func chatPrompt(body map[string]any) string {
	var sb strings.Builder
	msgs, _ := body["messages"].([]any)
	for _, m := range msgs {
		mm, _ := m.(map[string]any)
		fmt.Fprintf(&sb, "<%v>%v\n", mm["role"], mm["content"])
	}
	sb.WriteString("<assistant>")
	return sb.String()
}

func (fs *fakeServer) handler() http.Handler {
	m := http.NewServeMux()
	m.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, map[string]string{"status": "ok"}) })
	m.HandleFunc("GET /props", func(w http.ResponseWriter, r *http.Request) {
		fs.mu.Lock()
		defer fs.mu.Unlock()
		writeJSON(w, map[string]any{"total_slots": len(fs.slots), "model_path": fs.model, "build_info": fs.build,
			"default_generation_settings": map[string]any{"n_ctx": fs.nCtx}, "modalities": map[string]bool{"vision": false}})
	})
	m.HandleFunc("GET /slots", func(w http.ResponseWriter, r *http.Request) {
		fs.mu.Lock()
		defer fs.mu.Unlock()
		var out []map[string]any
		fs.tasks++ // every call is a task of the server's queue
		for i, s := range fs.slots {
			e := map[string]any{"id": i, "n_ctx": fs.nCtx, "is_processing": s.computing || fs.busy[i]}
			if s.task != nil {
				e["id_task"] = *s.task
				e["n_prompt_tokens"] = len(s.tokens)
			}
			out = append(out, e)
		}
		writeJSON(w, out)
	})
	m.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		fs.mu.Lock()
		extra := make([]int32, fs.tokenShift)
		fs.mu.Unlock()
		writeJSON(w, map[string]any{"tokens": append(tokenize(body["content"]), extra...)})
	})
	m.HandleFunc("POST /apply-template", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		writeJSON(w, map[string]any{"prompt": chatPrompt(body)})
	})
	m.HandleFunc("POST /slots/{id}", fs.slotAction)
	m.HandleFunc("POST /completion", fs.complete(completion))
	m.HandleFunc("POST /v1/chat/completions", fs.complete(chat))
	m.HandleFunc("POST /v1/responses", fs.complete(responses))
	m.HandleFunc("POST /v1/messages", fs.complete(messages))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fs.apiKey != "" && r.URL.Path != "/health" && r.Header.Get("Authorization") != "Bearer "+fs.apiKey {
			fakeError(w, 401, "Invalid API Key")
			return
		}
		m.ServeHTTP(w, r)
	})
}

func (fs *fakeServer) slotAction(w http.ResponseWriter, r *http.Request) {
	id, _ := strconv.Atoi(r.PathValue("id"))
	var body struct {
		Filename string `json:"filename"`
	}
	_ = json.NewDecoder(r.Body).Decode(&body)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if id < 0 || id >= len(fs.slots) || strings.ContainsAny(body.Filename, "/\\") {
		fakeError(w, 400, "Invalid slot ID or filename")
		return
	}
	assert.False(fs.t, fs.slots[id].computing, "slot %s on slot %d while it computes", r.URL.Query().Get("action"), id)
	path := fs.dir + body.Filename
	fs.tasks++
	switch r.URL.Query().Get("action") {
	case "erase":
		n := len(fs.slots[id].tokens)
		fs.slots[id].tokens = nil
		writeJSON(w, map[string]any{"id_slot": id, "n_erased": n})
	case "save":
		b := fs.slotFile(id, fs.slots[id].tokens)
		if err := os.WriteFile(path, b, 0o644); err != nil {
			fakeError(w, 500, err.Error())
			return
		}
		writeJSON(w, map[string]any{"id_slot": id, "filename": body.Filename, "n_saved": len(fs.slots[id].tokens), "n_written": len(b)})
	case "restore":
		fs.restores = append(fs.restores, id)
		b, err := os.ReadFile(path)
		var toks []int32
		if err == nil && !fs.refuseRestore {
			toks, err = fs.load(b)
		}
		if err != nil || fs.refuseRestore {
			fs.slots[id].tokens = nil // llama-server clears the slot
			fakeError(w, 400, "Unable to restore slot: No available space in KV cache or invalid slot save file")
			return
		}
		fs.slots[id].tokens = toks
		writeJSON(w, map[string]any{"id_slot": id, "filename": body.Filename, "n_restored": len(toks), "n_read": len(b)})
	default:
		fakeError(w, 400, "Invalid action")
	}
}

// fakePrompt is the prompt the fake computes for a request of ep: the
// body converted as llama-server converts it, then its chat template.
func fakePrompt(t testing.TB, ep endpoint, raw []byte, body map[string]any) []int32 {
	switch ep {
	case completion:
		return tokenize(body["prompt"])
	case responses, messages:
		conv := responsesToChat
		if ep == messages {
			conv = messagesToChat
		}
		b, err := conv(raw)
		if err != nil {
			return nil
		}
		var chatBody map[string]any
		// The handler's goroutine is not the test's: assert, not require.
		assert.NoError(t, json.Unmarshal(b, &chatBody))
		body = chatBody
	}
	return tokenize(chatPrompt(body))
}

// pickSlot is llama-server's own choice of a slot (get_available_slot):
// the idle slot whose tokens share the largest part of the prompt, above
// the similarity threshold, else the first idle one.
func (fs *fakeServer) pickSlot(prompt []int32) int {
	best, bestSim := -1, 0.1 // llama-server's default --slot-prompt-similarity
	for i, sl := range fs.slots {
		if sl.computing || len(sl.tokens) == 0 {
			continue
		}
		if sim := float64(lcp(sl.tokens, prompt)) / float64(len(prompt)); sim > bestSim {
			best, bestSim = i, sim
		}
	}
	if best >= 0 {
		return best
	}
	for i := range fs.slots {
		if !fs.slots[i].computing {
			return i
		}
	}
	return -1
}

// restart makes the fake a new server process on the same port: no slot
// holds anything, and task ids start again.
func (fs *fakeServer) restart() {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.slots = make([]fakeSlot, len(fs.slots))
	fs.tasks = 0
}

// kill stops the fake as a killed process stops: connections drop and the
// port refuses new ones.
func (fs *fakeServer) kill() {
	fs.srv.Listener.Close()
	fs.srv.CloseClientConnections()
}

func (fs *fakeServer) complete(ep endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		var body map[string]any
		if err := json.Unmarshal(raw, &body); err != nil {
			fakeError(w, 400, "bad json")
			return
		}
		prompt := fakePrompt(fs.t, ep, raw, body)
		nPredict := 4
		for _, k := range []string{"n_predict", "max_tokens", "max_output_tokens"} {
			if v, ok := body[k].(float64); ok {
				nPredict = int(v)
			}
		}
		cache := true
		if v, ok := body["cache_prompt"].(bool); ok && ep != messages {
			cache = v
		}
		stream, _ := body["stream"].(bool)
		fs.mu.Lock()
		fs.requests = append(fs.requests, body)
		if fs.completionCode != 0 {
			fs.mu.Unlock()
			fakeError(w, fs.completionCode, "the fake failed on purpose")
			return
		}
		id := -1
		if v, ok := body["id_slot"].(float64); ok && v >= 0 && ep != messages {
			id = int(v) % len(fs.slots)
			if fs.slots[id].computing {
				fs.overlaps++
			}
		} else {
			id = fs.pickSlot(prompt)
		}
		if id < 0 {
			fs.mu.Unlock()
			fakeError(w, 503, "no slot")
			return
		}
		sl := &fs.slots[id]
		nPast := 0
		if cache {
			nPast = lcp(sl.tokens, prompt)
			if nPast == len(prompt) && nPast > 0 {
				nPast--
			}
		}
		if v, ok := body["n_cache_reuse"].(float64); ok && v > 0 && len(sl.tokens) > nPast {
			// Chunk reuse claims cells past the common prefix.
			nPast = min(len(prompt)-1, len(sl.tokens))
		}
		sl.computing = true
		fs.tasks++
		task := fs.tasks
		gate := fs.gate
		fs.mu.Unlock()

		gen := fs.answerTokens(prompt, nPredict)
		tm := map[string]any{"cache_n": nPast, "prompt_n": len(prompt) - nPast, "prompt_ms": 1.5, "predicted_n": nPredict, "predicted_ms": 2.0 * float64(nPredict)}
		finish := func() {
			fs.mu.Lock()
			sl.tokens = append(append([]int32(nil), prompt...), gen[:max(nPredict-1, 0)]...)
			sl.computing = false
			sl.task = &task
			fs.mu.Unlock()
		}
		text := fmt.Sprint(gen)
		verbose, _ := body["verbose"].(bool)
		perToken, _ := body["timings_per_token"].(bool)
		// The shapes of llama-server's answers, with a fixed id.
		const cmplID, model = "chatcmpl-fake", "fake"
		chatUsage := map[string]any{"completion_tokens": nPredict, "prompt_tokens": len(prompt), "total_tokens": nPredict + len(prompt),
			"prompt_tokens_details": map[string]any{"cached_tokens": nPast}}
		messagesUsage := map[string]any{"cache_read_input_tokens": nPast, "input_tokens": len(prompt) - nPast, "output_tokens": nPredict}
		if !stream {
			finish()
			switch ep {
			case chat:
				ans := map[string]any{"choices": []any{map[string]any{"finish_reason": "length", "index": 0,
					"message": map[string]any{"role": "assistant", "content": text}}},
					"model": model, "object": "chat.completion", "usage": chatUsage, "id": cmplID, "timings": tm}
				if verbose {
					ans["__verbose"] = map[string]any{"content": text, "stopping_word": ""}
				}
				writeJSON(w, ans)
			case responses:
				writeJSON(w, map[string]any{"object": "response", "output": []any{map[string]any{"type": "message", "content": []any{map[string]any{"type": "output_text", "text": text}}}},
					"usage": map[string]any{"input_tokens": len(prompt), "output_tokens": nPredict, "input_tokens_details": map[string]any{"cached_tokens": nPast}}})
			case messages:
				writeJSON(w, map[string]any{"id": cmplID, "type": "message", "role": "assistant", "content": []any{map[string]any{"type": "text", "text": text}},
					"model": model, "stop_reason": "max_tokens", "stop_sequence": nil, "usage": messagesUsage})
			default:
				writeJSON(w, map[string]any{"content": text, "tokens": gen, "id_slot": id, "stop": true, "truncated": false, "timings": tm})
			}
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		event := func(name string, v any) {
			ev, _ := json.Marshal(v)
			if name != "" {
				fmt.Fprintf(w, "event: %s\n", name)
			}
			fmt.Fprintf(w, "data: %s\n\n", ev)
			fl.Flush()
		}
		chunk := func(delta map[string]any, finish any) map[string]any {
			return map[string]any{"choices": []any{map[string]any{"finish_reason": finish, "index": 0, "delta": delta}},
				"id": cmplID, "model": model, "object": "chat.completion.chunk"}
		}
		block := func(typ string, v map[string]any) map[string]any {
			v["type"] = typ
			return v
		}
		for i, g := range gen {
			if i > 0 && gate != nil {
				<-gate
			}
			piece := fmt.Sprint(g)
			switch ep {
			case chat:
				c := chunk(map[string]any{"content": piece}, nil)
				if i == 0 {
					first := chunk(map[string]any{"role": "assistant", "content": nil}, nil)
					event("", first)
				}
				if perToken {
					c["timings"] = tm
				}
				event("", c)
			case messages:
				if i == 0 {
					event("message_start", block("message_start", map[string]any{"message": map[string]any{"id": cmplID, "type": "message", "role": "assistant",
						"content": []any{}, "model": model, "stop_reason": nil, "stop_sequence": nil,
						"usage": map[string]any{"cache_read_input_tokens": nPast, "input_tokens": len(prompt) - nPast, "output_tokens": 0}}}))
					event("content_block_start", block("content_block_start", map[string]any{"index": 0, "content_block": map[string]any{"type": "text", "text": ""}}))
				}
				event("content_block_delta", block("content_block_delta", map[string]any{"index": 0, "delta": map[string]any{"type": "text_delta", "text": piece}}))
			default:
				event("", map[string]any{"content": piece, "tokens": []int32{g}, "stop": false})
			}
		}
		finish()
		switch ep {
		case chat:
			c := chunk(map[string]any{}, "length")
			c["timings"] = tm
			if verbose {
				c["__verbose"] = map[string]any{"content": "", "stopping_word": ""}
			}
			event("", c)
			fmt.Fprint(w, "data: [DONE]\n\n")
		case messages:
			if len(gen) > 0 {
				event("content_block_stop", block("content_block_stop", map[string]any{"index": 0}))
			}
			event("message_delta", block("message_delta", map[string]any{"delta": map[string]any{"stop_reason": "max_tokens", "stop_sequence": nil},
				"usage": map[string]any{"output_tokens": nPredict}}))
			event("message_stop", block("message_stop", map[string]any{}))
		case responses:
			event("", map[string]any{"type": "response.completed", "response": map[string]any{"usage": map[string]any{
				"input_tokens": len(prompt), "output_tokens": nPredict, "input_tokens_details": map[string]any{"cached_tokens": nPast}}}, "timings": tm})
		default:
			event("", map[string]any{"content": "", "stop": true, "timings": tm})
		}
	}
}
