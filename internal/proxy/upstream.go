package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/mcbridge/mcbridge/internal/status"
)

// upstream calls llama-server's own API: the control calls the proxy makes
// on its own behalf, never the clients' requests.
type upstream struct {
	base   *url.URL
	client *http.Client
	apiKey string // the server's --api-key, for the proxy's own calls
}

// maxControlBody bounds what a control call reads back; the largest are
// /props (chat templates) and /tokenize of a long prompt.
const maxControlBody = 64 << 20

// isTransport: the call got no answer from the server.
func isTransport(err error) bool { return status.Of(err) == status.Transfer }

// upstreamError is a control call the server answered with an error.
type upstreamError struct {
	Path   string
	Status int
	Body   string
}

func (e *upstreamError) Error() string {
	return fmt.Sprintf("%s: HTTP %d: %s", e.Path, e.Status, e.Body)
}

func (u *upstream) url(path string, query url.Values) string {
	r := *u.base
	r.Path = joinPath(u.base.Path, path)
	r.RawQuery = query.Encode()
	return r.String()
}

// joinPath appends an absolute path to the upstream's base path.
func joinPath(base, path string) string {
	for len(base) > 0 && base[len(base)-1] == '/' {
		base = base[:len(base)-1]
	}
	return base + path
}

// call sends one control request and decodes a JSON answer into out.
func (u *upstream) call(ctx context.Context, method, path string, query url.Values, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return status.Wrap(status.Internal, err, "encoding "+path)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.url(path, query), body)
	if err != nil {
		return status.Wrap(status.InvalidArg, err, path)
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if u.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+u.apiKey)
	}
	resp, err := u.client.Do(req)
	if err != nil {
		return status.Wrap(status.Transfer, err, path)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxControlBody+1))
	if err != nil {
		return status.Wrap(status.Transfer, err, path)
	}
	if len(b) > maxControlBody {
		return status.Errorf(status.Unsupported, "%s: answer over %d bytes", path, maxControlBody)
	}
	if resp.StatusCode/100 != 2 {
		if len(b) > 512 {
			b = b[:512]
		}
		return &upstreamError{Path: path, Status: resp.StatusCode, Body: string(b)}
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return status.Wrap(status.Unsupported, err, "decoding "+path)
	}
	return nil
}

// props is the part of GET /props the proxy keys on.
type props struct {
	TotalSlots int    `json:"total_slots"`
	ModelPath  string `json:"model_path"`
	BuildInfo  string `json:"build_info"`
	Settings   struct {
		NCtx int `json:"n_ctx"`
	} `json:"default_generation_settings"`
	Modalities map[string]bool `json:"modalities"`
}

func (u *upstream) props(ctx context.Context) (props, error) {
	var p props
	err := u.call(ctx, http.MethodGet, "/props", nil, nil, &p)
	return p, err
}

// slotInfo is one entry of GET /slots (server_slot::to_json).
type slotInfo struct {
	ID           int  `json:"id"`
	NCtx         int  `json:"n_ctx"`
	IsProcessing bool `json:"is_processing"`
	// IDTask is the last task run in the slot (absent before the first);
	// NPromptTokens is how many tokens the slot holds (prompt.tokens, the
	// prompt and what was generated; 0 after an erase), present with it.
	IDTask        *int `json:"id_task"`
	NPromptTokens int  `json:"n_prompt_tokens"`
}

func (u *upstream) slots(ctx context.Context) ([]slotInfo, error) {
	var s []slotInfo
	err := u.call(ctx, http.MethodGet, "/slots", nil, nil, &s)
	return s, err
}

// tokenize asks the server for the tokens it would compute for a prompt
// (a string, or a list of strings and token ids), with the BOS and special
// token parsing that completions use.
func (u *upstream) tokenize(ctx context.Context, content any) ([]int32, error) {
	var out struct {
		Tokens []int32 `json:"tokens"`
	}
	in := map[string]any{"content": content, "add_special": true, "parse_special": true}
	if err := u.call(ctx, http.MethodPost, "/tokenize", nil, in, &out); err != nil {
		return nil, err
	}
	return out.Tokens, nil
}

// applyTemplate renders a chat request's messages into the prompt string
// the server would compute.
func (u *upstream) applyTemplate(ctx context.Context, body json.RawMessage) (string, error) {
	var out struct {
		Prompt *string `json:"prompt"`
	}
	if err := u.call(ctx, http.MethodPost, "/apply-template", nil, body, &out); err != nil {
		return "", err
	}
	if out.Prompt == nil {
		return "", status.Errorf(status.Unsupported, "/apply-template gave no prompt string")
	}
	return *out.Prompt, nil
}

// slotResult is the answer to a slot save or restore.
type slotResult struct {
	Saved    int `json:"n_saved"`
	Restored int `json:"n_restored"`
}

// slotAction runs save or restore of filename (inside the server's slot
// directory) on slot id.
func (u *upstream) slotAction(ctx context.Context, id int, action, filename string) (slotResult, error) {
	var r slotResult
	err := u.call(ctx, http.MethodPost, "/slots/"+strconv.Itoa(id), url.Values{"action": {action}},
		map[string]string{"filename": filename}, &r)
	return r, err
}

// complete runs a completion for the proxy itself (the KV probe).
func (u *upstream) complete(ctx context.Context, req map[string]any) error {
	return u.call(ctx, http.MethodPost, "/completion", nil, req, nil)
}
