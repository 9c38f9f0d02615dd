package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	ooption "github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/testenv"
)

// agentSystem is a system prompt of more than ten blocks.
var agentSystem = strings.Repeat("You are an agent of a swarm. Follow the repository conventions. ", 12)

// agentRequest is one turn of an agent, sent through the SDKs as Anthropic
// Messages (what Claude Code sends) or OpenAI Responses (what Codex sends).
type agentRequest struct {
	system, user string
	// tools: the agent offers a read_file tool and must call a tool;
	// toolTurn: the conversation holds a call of it and its result.
	tools, toolTurn bool
	max             int64
}

const readFileResult = "package main\n\nfunc main() {}\n"

func messagesParams(r agentRequest) anthropic.MessageNewParams {
	msgs := []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(r.user))}
	if r.toolTurn {
		msgs = append(msgs,
			anthropic.NewAssistantMessage(anthropic.NewToolUseBlock("toolu_1", map[string]any{"path": "main.go"}, "read_file")),
			anthropic.NewUserMessage(anthropic.NewToolResultBlock("toolu_1", readFileResult, false)))
	}
	p := anthropic.MessageNewParams{Model: "tiny", MaxTokens: r.max, System: []anthropic.TextBlockParam{{Text: r.system}},
		Messages: msgs}
	if r.tools {
		p.Tools = []anthropic.ToolUnionParam{{OfTool: &anthropic.ToolParam{Name: "read_file", Description: anthropic.String("Reads a file of the repository."),
			InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"path": map[string]any{"type": "string"}}, Required: []string{"path"}}}}}
		p.ToolChoice = anthropic.ToolChoiceUnionParam{OfAny: &anthropic.ToolChoiceAnyParam{}}
	}
	return p
}

func responsesParams(r agentRequest) responses.ResponseNewParams {
	p := responses.ResponseNewParams{Model: "tiny", Instructions: openai.String(r.system), MaxOutputTokens: openai.Int(r.max),
		Temperature: openai.Float(0)}
	if r.toolTurn {
		result := responses.ResponseInputItemParamOfFunctionCallOutput(readFileResult)
		result.OfFunctionCallOutput.CallID = openai.String("call_1")
		p.Input = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{
			responses.ResponseInputItemParamOfMessage(r.user, responses.EasyInputMessageRoleUser),
			responses.ResponseInputItemParamOfFunctionCall(`{"path":"main.go"}`, "call_1", "read_file"),
			result,
		}}
	} else {
		p.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String(r.user)}
	}
	if r.tools {
		p.Tools = []responses.ToolUnionParam{{OfFunction: &responses.FunctionToolParam{Name: "read_file",
			Description: openai.String("Reads a file of the repository."), Strict: openai.Bool(false),
			Parameters: map[string]any{"type": "object", "properties": map[string]any{"path": map[string]any{"type": "string"}}, "required": []string{"path"}}}}}
		p.ToolChoice = responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsRequired)}
	}
	return p
}

// sdkCall is one SDK call: what the SDK decoded, and the raw answer it
// decoded it from.
type sdkCall struct {
	// answer is the decoded message without ids: its content blocks or
	// output items, stop reason or status, and usage.
	answer string
	header http.Header
	raw    bytes.Buffer
}

func (c *sdkCall) restored() int {
	n, _ := strconv.Atoi(c.header.Get("Mcb-Restored-N"))
	return n
}

func (c *sdkCall) upstream() int {
	n, err := strconv.Atoi(c.header.Get("Mcb-Upstream"))
	if err != nil {
		return -1
	}
	return n
}

// record is SDK middleware keeping the raw answer.
func (c *sdkCall) record(req *http.Request, next func(*http.Request) (*http.Response, error)) (*http.Response, error) {
	resp, err := next(req)
	if err == nil {
		c.header = resp.Header
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.TeeReader(resp.Body, &c.raw), resp.Body}
	}
	return resp, err
}

// callAgent sends r to base's /v1/messages or /v1/responses with the
// vendor's SDK, streamed or not.
func callAgent(t *testing.T, base, api string, r agentRequest, stream bool) *sdkCall {
	t.Helper()
	c := &sdkCall{}
	ctx := context.Background()
	switch api {
	case "messages":
		cl := anthropic.NewClient(aoption.WithBaseURL(base), aoption.WithAPIKey("none"), aoption.WithMaxRetries(0),
			aoption.WithHTTPClient(testenv.Client), aoption.WithMiddleware(c.record),
			// Greedy: the SDK has no temperature field, llama-server
			// reads one.
			aoption.WithJSONSet("temperature", 0))
		var msg anthropic.Message
		if stream {
			s := cl.Messages.NewStreaming(ctx, messagesParams(r))
			for s.Next() {
				require.NoError(t, msg.Accumulate(s.Current()))
			}
			require.NoError(t, s.Err(), "%s", c.raw.Bytes())
		} else {
			m, err := cl.Messages.New(ctx, messagesParams(r))
			require.NoError(t, err, "%s", c.raw.Bytes())
			msg = *m
		}
		var blocks []string
		for _, b := range msg.Content {
			switch b.Type {
			case "tool_use":
				blocks = append(blocks, fmt.Sprintf("tool_use %s %s", b.Name, b.Input))
			default:
				blocks = append(blocks, fmt.Sprintf("%s %q %q", b.Type, b.Text, b.Thinking))
			}
		}
		c.answer = fmt.Sprintf("%v stop=%s %q in=%d cached=%d out=%d", blocks, msg.StopReason, msg.StopSequence,
			msg.Usage.InputTokens, msg.Usage.CacheReadInputTokens, msg.Usage.OutputTokens)
	case "responses":
		cl := openai.NewClient(ooption.WithBaseURL(base+"/v1/"), ooption.WithAPIKey("none"), ooption.WithMaxRetries(0),
			ooption.WithHTTPClient(testenv.Client), ooption.WithMiddleware(c.record))
		var resp responses.Response
		if stream {
			s := cl.Responses.NewStreaming(ctx, responsesParams(r))
			done := false
			for s.Next() {
				if ev := s.Current(); ev.Type == "response.completed" {
					resp, done = ev.Response, true
				}
			}
			require.NoError(t, s.Err(), "%s", c.raw.Bytes())
			require.True(t, done, "a completed response: %s", c.raw.Bytes())
		} else {
			rp, err := cl.Responses.New(ctx, responsesParams(r))
			require.NoError(t, err, "%s", c.raw.Bytes())
			resp = *rp
		}
		var items []string
		for _, it := range resp.Output {
			switch it.Type {
			case "function_call":
				items = append(items, fmt.Sprintf("function_call %s %s", it.Name, it.Arguments.OfString))
			default:
				items = append(items, fmt.Sprintf("%s %q", it.Type, resp.OutputText()))
			}
		}
		c.answer = fmt.Sprintf("%v status=%s in=%d cached=%d out=%d", items, resp.Status,
			resp.Usage.InputTokens, resp.Usage.InputTokensDetails.CachedTokens, resp.Usage.OutputTokens)
	default:
		t.Fatalf("no API %q", api)
	}
	return c
}

// runMasked are the members whose values differ between two runs of one
// answer: ids, timestamps and timings.
var runMasked = map[string]bool{"id": true, "call_id": true, "item_id": true, "created": true, "created_at": true,
	"completed_at": true, "system_fingerprint": true}

// canonical is a raw answer, JSON or server-sent events, as a list of its
// events in order, each its JSON members in order with the values that
// differ between runs masked and timings left out: two runs of one answer
// in the same cache state give equal lists.
func canonical(t *testing.T, raw []byte) []string {
	t.Helper()
	if b := bytes.TrimSpace(raw); len(b) > 0 && b[0] == '{' {
		return []string{canonicalJSON(t, b)}
	}
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch data, ok := strings.CutPrefix(line, "data: "); {
		case ok && data != "[DONE]":
			out = append(out, "data: "+canonicalJSON(t, []byte(data)))
		case line != "":
			out = append(out, line)
		}
	}
	return out
}

func canonicalJSON(t *testing.T, b []byte) string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var sb strings.Builder
	var value func(w io.Writer, mask bool)
	value = func(w io.Writer, mask bool) {
		tok, err := dec.Token()
		require.NoError(t, err, "%s", b)
		switch tok {
		case json.Delim('{'):
			io.WriteString(w, "{")
			for dec.More() {
				k, err := dec.Token()
				require.NoError(t, err, "%s", b)
				key := k.(string)
				inner := w
				if key == "timings" {
					inner = io.Discard
				}
				fmt.Fprintf(inner, "%q:", key)
				value(inner, runMasked[key])
				io.WriteString(inner, ",")
			}
			_, err := dec.Token()
			require.NoError(t, err)
			io.WriteString(w, "}")
		case json.Delim('['):
			io.WriteString(w, "[")
			for dec.More() {
				value(w, false)
				io.WriteString(w, ",")
			}
			_, err := dec.Token()
			require.NoError(t, err)
			io.WriteString(w, "]")
		default:
			if mask {
				io.WriteString(w, "*")
			} else {
				fmt.Fprintf(w, "%#v", tok)
			}
		}
	}
	value(&sb, false)
	return sb.String()
}

// The proxy's answers to the agent APIs are llama-server's own: the same
// Messages and Responses requests, with tools and streamed or not, sent
// through the real SDKs straight to a stock server and through the proxy
// (which sends a Messages request as a chat pinned to a slot and writes
// the answer back) give equal answers member by member, in order, apart
// from ids, timestamps and timings, and equal event sequences. Both
// servers see the same requests in the same order from one slot, so the
// cache state of every comparison is the same (no restore happens), and no
// request holds more than its slot.
func TestProxyAgentAPICompat(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	// A template with a tool-call format, so that the tools and the
	// tool-result turns are rendered as a tool-using model's are. (The
	// generated model calls no tool even when one is required: the
	// tool_use answers are internal/proxy's anthropic_test.go's.)
	args := append(testenv.ServerArgs(model, 4096, 1, "on"), "--chat-template-file", testenv.LlamaTemplate(t, "Qwen-Qwen2.5-7B-Instruct.jinja"))
	dir := testenv.SlotDir(t, "u0")
	up := testenv.StartLlama(t, "u0", testenv.StockServer(t), append(args, "--slot-save-path", dir))
	px := &testenv.Proxy{Server: testenv.StartServer(t, "proxy", testenv.Mcbridge(t),
		[]string{"proxy", "--config", routeConfig, "--upstream", up.URL + ",slots=" + dir}, nil, func(port int) []string {
			return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
		}, "/healthz")}
	ref := testenv.StartLlama(t, "ref", testenv.StockServer(t), args)
	i := 0
	for _, shape := range []struct{ tools, toolTurn bool }{{false, false}, {true, false}, {true, true}} {
		for _, api := range []string{"messages", "responses"} {
			for _, stream := range []bool{false, true} {
				i++
				name := fmt.Sprintf("%s stream=%v tools=%v toolTurn=%v", api, stream, shape.tools, shape.toolTurn)
				r := agentRequest{system: agentSystem, user: fmt.Sprintf("Case %d: list the files.", i), tools: shape.tools, toolTurn: shape.toolTurn, max: 48}
				direct := callAgent(t, ref.URL, api, r, stream)
				through := callAgent(t, px.URL, api, r, stream)
				assert.Zero(t, through.restored(), "%s: no restore, the same cache state", name)
				assert.Equal(t, direct.header.Get("Content-Type"), through.header.Get("Content-Type"), name)
				assert.Equal(t, canonical(t, direct.raw.Bytes()), canonical(t, through.raw.Bytes()), "%s: the stock server's answer", name)
				assert.Equal(t, direct.answer, through.answer, "%s: as the SDK reads it", name)
				settled(t, px)
			}
		}
	}
	m := testenv.Metrics(t, px.URL+"/metrics")
	assert.Zero(t, m["mcproxy_exclusive_total"], "no agent request held every slot")
	assert.Zero(t, m["mcproxy_answer_mismatches_total"], "the proxy's tokens were the server's every time")
}

// The agent APIs through the proxy, through the real SDKs: a first request
// computes on one server, a second with the same system prompt goes to the
// other (round robin) and is restored there from the proxy's bridge. Its
// answer, plain and streamed, with tools or not, is a stock server's in
// the same cache state: the stock server gets the very slot file the
// proxy restored, then the request.
func TestProxyAgentAPIs(t *testing.T) {
	model := testenv.Model(t, "tiny", 0)
	u := startRouted(t, model, 2, 1, "--route", "round-robin")
	refDir := testenv.SlotDir(t, "ref")
	ref := stockUpstream(t, "ref", model, 1, refDir, 0)
	// Without tools, both APIs become this chat on the server.
	chatTokens := func(system, user string) []int32 {
		var tmpl struct {
			Prompt string `json:"prompt"`
		}
		testenv.Post(t, ref.URL+"/apply-template", map[string]any{"messages": []any{
			map[string]any{"role": "system", "content": system}, map[string]any{"role": "user", "content": user}}}, &tmpl)
		var tok struct {
			Tokens []int32 `json:"tokens"`
		}
		testenv.Post(t, ref.URL+"/tokenize", map[string]any{"content": tmpl.Prompt, "add_special": true, "parse_special": true}, &tok)
		return tok.Tokens
	}
	restored := 0.0
	for _, tools := range []bool{false, true} {
		for _, api := range []string{"messages", "responses"} {
			for _, stream := range []bool{false, true} {
				name := fmt.Sprintf("%s stream=%v tools=%v", api, stream, tools)
				// Each case has its own system prompt: the slots hold
				// nothing of it before.
				system := fmt.Sprintf("%s. %s", name, agentSystem)
				a := agentRequest{system: system, user: "list the files, please", tools: tools, max: 8}
				b := a
				b.user = "and now the tests, please"

				// Counted before the first request: its blocks are
				// published asynchronously and may already be mirrored
				// once it settles.
				mirrored := testenv.Metrics(t, u.proxy.URL+"/metrics")["mcbridge_mirrored_blocks"]
				first := callAgent(t, u.proxy.URL, api, a, stream)
				settled(t, u.proxy)
				var usage struct {
					Usage struct {
						Input     int `json:"input_tokens"`
						CacheRead int `json:"cache_read_input_tokens"`
					} `json:"usage"`
				}
				require.NoError(t, json.Unmarshal(lastUsage(first.raw.Bytes()), &usage), "%s", first.raw.Bytes())
				promptA := usage.Usage.Input + usage.Usage.CacheRead
				waitMirrored(t, u.proxy.URL, int(mirrored)+(promptA-1)/block)
				second := callAgent(t, u.proxy.URL, api, b, stream)
				assert.NotEqual(t, first.upstream(), second.upstream(), "%s: round robin", name)
				require.Positive(t, second.restored(), "%s: the shared prefix is restored", name)
				assert.Zero(t, second.restored()%block, "%s: whole blocks", name)
				if !tools {
					ta, tb := chatTokens(system, a.user), chatTokens(system, b.user)
					n := 0
					for n < min(len(ta), len(tb)) && ta[n] == tb[n] {
						n++
					}
					assert.Equal(t, n/block*block, second.restored(), "%s: the shared full blocks are restored", name)
				}
				restored += float64(second.restored())
				settled(t, u.proxy)

				// The stock server in the same cache state: the slot
				// file the proxy restored, then the request.
				files, err := filepath.Glob(filepath.Join(u.dirs[second.upstream()], "mcb-*-r0-*.bin"))
				require.NoError(t, err)
				require.Len(t, files, 1, "the proxy's restore file")
				blob, err := os.ReadFile(files[0])
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(filepath.Join(refDir, "same.bin"), blob, 0o644))
				var rs struct {
					N int `json:"n_restored"`
				}
				testenv.Post(t, ref.URL+"/slots/0?action=restore", map[string]any{"filename": "same.bin"}, &rs)
				require.Equal(t, second.restored(), rs.N)
				want := callAgent(t, ref.URL, api, b, stream)
				assert.Equal(t, canonical(t, want.raw.Bytes()), canonical(t, second.raw.Bytes()), "%s: a stock server's answer", name)
				assert.Equal(t, want.answer, second.answer, "%s: as the SDK reads it", name)
			}
		}
	}
	m := testenv.Metrics(t, u.proxy.URL+"/metrics")
	assert.Equal(t, restored, m["mcbridge_restored_tokens_total"])
	assert.Zero(t, m["mcproxy_answer_mismatches_total"], "the proxy's tokens were the server's every time")
	assert.Zero(t, m["mcproxy_exclusive_total"], "no agent request held every slot")
}

// lastUsage is the JSON object that holds an answer's final prompt counts:
// the answer itself, or the stream event with them (Anthropic's
// message_start, Responses' response.completed).
func lastUsage(raw []byte) []byte {
	if b := bytes.TrimSpace(raw); len(b) > 0 && b[0] == '{' {
		return b
	}
	var out []byte
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || !strings.Contains(data, `"input_tokens"`) {
			continue
		}
		var ev struct {
			Message  json.RawMessage `json:"message"`
			Response json.RawMessage `json:"response"`
		}
		if json.Unmarshal([]byte(data), &ev) != nil {
			continue
		}
		for _, inner := range []json.RawMessage{ev.Message, ev.Response} {
			if len(inner) > 0 {
				out = inner
			}
		}
	}
	return out
}
