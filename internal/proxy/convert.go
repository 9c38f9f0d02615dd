package proxy

import (
	"encoding/json"
	"math"
	"strconv"
	"strings"

	"github.com/mcbridge/mcbridge/internal/status"
)

// llama-server v0.5.0 turns /v1/responses and /v1/messages requests into
// chat completions before its chat template sees them
// (tools/server/server-chat.cpp: server_chat_convert_responses_to_chatcmpl,
// server_chat_convert_anthropic_to_oai), and offers no endpoint that
// renders those shapes. The proxy repeats the conversion here, statement
// for statement, and renders the result with the server's own
// /apply-template and /tokenize. Where it errs the cost is a restore the
// server does not use (it reuses only what matches), never a wrong answer;
// the answer's usage counts show it (mcproxy_answer_mismatches_total).

// responsesToChat is server_chat_convert_responses_to_chatcmpl.
func responsesToChat(body []byte) ([]byte, error) {
	in, err := parseObject(body)
	if err != nil {
		return nil, err
	}
	if !in.has("input") {
		return nil, status.Errorf(status.InvalidArg, "'input' is required")
	}
	if in.str("previous_response_id") != "" {
		return nil, status.Errorf(status.Unsupported, "'previous_response_id' is not supported")
	}
	out := in.clone()
	out.del("input")
	var msgs []any
	if in.has("instructions") {
		msgs = append(msgs, newObject("role", "system", "content", in.str("instructions")))
		out.del("instructions")
	}
	switch input := in.get("input").(type) {
	case string:
		msgs = append(msgs, newObject("role", "user", "content", input))
	case []any:
		for _, e := range input {
			item, ok := cloneValue(e).(*object)
			if !ok {
				return nil, status.Errorf(status.InvalidArg, "cannot determine type of 'item'")
			}
			var err error
			if msgs, err = responsesItem(msgs, item); err != nil {
				return nil, err
			}
		}
	default:
		return nil, status.Errorf(status.InvalidArg, "'input' must be a string or array of objects")
	}
	if msgs == nil {
		msgs = []any{}
	}
	out.set("messages", msgs)
	if in.has("tools") {
		tools, ok := in.get("tools").([]any)
		if !ok {
			return nil, status.Errorf(status.InvalidArg, "'tools' must be an array of objects")
		}
		var chatTools []any
		for _, t := range tools {
			tool, ok := cloneValue(t).(*object)
			if !ok || tool.str("type") != "function" {
				continue // no chat-completions equivalent: the server skips it too
			}
			tool.del("type")
			if !tool.has("strict") {
				tool.set("strict", true)
			}
			chatTools = append(chatTools, newObject("type", "function", "function", tool))
		}
		out.del("tools")
		if len(chatTools) > 0 {
			out.set("tools", chatTools)
		}
	}
	if in.has("max_output_tokens") {
		out.del("max_output_tokens")
		out.set("max_tokens", in.get("max_output_tokens"))
	}
	if in.has("reasoning") {
		if r, ok := in.get("reasoning").(*object); ok && r.has("effort") {
			out.set("reasoning_effort", r.get("effort"))
		}
		out.del("reasoning")
	}
	return out.MarshalJSON()
}

// responsesItem converts one input item, appending to msgs.
func responsesItem(msgs []any, item *object) ([]any, error) {
	var prev *object
	if len(msgs) > 0 {
		prev, _ = msgs[len(msgs)-1].(*object)
	}
	mergePrev := prev != nil && prev.str("role") == "assistant"
	if item.isString("content") {
		item.set("content", []any{newObject("text", item.get("content"), "type", "input_text")})
	}
	role, _ := item.get("role").(string)
	typ, _ := item.get("type").(string)
	switch {
	case item.isArray("content") && (role == "user" || role == "system" || role == "developer"):
		var parts []any
		for _, p := range item.get("content").([]any) {
			part, _ := p.(*object)
			if part == nil {
				part = newObject()
			}
			switch part.str("type") {
			case "input_text":
				if !part.has("text") {
					return nil, status.Errorf(status.InvalidArg, "'Input text' requires 'text'")
				}
				parts = append(parts, newObject("text", part.get("text"), "type", "text"))
			case "input_image":
				if !part.has("image_url") {
					return nil, status.Errorf(status.InvalidArg, "'image_url' is required")
				}
				parts = append(parts, newObject("image_url", newObject("url", part.get("image_url")), "type", "image_url"))
			default:
				return nil, status.Errorf(status.Unsupported, "input part of type %q", part.str("type"))
			}
		}
		item.del("type")
		item.del("status")
		item.set("content", orEmpty(parts))
		return append(msgs, item), nil
	case role == "assistant" && typ == "message":
		var parts []any
		if c, ok := item.get("content").([]any); ok {
			for _, p := range c {
				part, _ := p.(*object)
				if part == nil {
					part = newObject()
				}
				switch part.str("type") {
				case "output_text", "input_text":
					if !part.isString("text") {
						return nil, status.Errorf(status.InvalidArg, "'Output text' requires 'text'")
					}
					parts = append(parts, newObject("text", part.get("text"), "type", "text"))
				case "refusal":
					if !part.isString("refusal") {
						return nil, status.Errorf(status.InvalidArg, "'Refusal' requires 'refusal'")
					}
					parts = append(parts, newObject("refusal", part.get("refusal"), "type", "refusal"))
				default:
					return nil, status.Errorf(status.InvalidArg, "'type' must be one of 'output_text' or 'refusal'")
				}
			}
		}
		if mergePrev {
			pc, ok := prev.get("content").([]any)
			if !ok {
				pc = []any{}
			}
			prev.set("content", append(pc, parts...))
			return msgs, nil
		}
		item.del("status")
		item.del("type")
		item.set("content", orEmpty(parts))
		return append(msgs, item), nil
	case item.isString("arguments") && item.isString("call_id") && item.isString("name") && typ == "function_call":
		call := newObject("function", newObject("arguments", item.get("arguments"), "name", item.get("name")),
			"id", item.get("call_id"), "type", "function")
		if mergePrev {
			tc, ok := prev.get("tool_calls").([]any)
			if !ok {
				tc = []any{}
			}
			prev.set("tool_calls", append(tc, call))
			return msgs, nil
		}
		return append(msgs, newObject("role", "assistant", "tool_calls", []any{call})), nil
	case item.isString("call_id") && (item.isString("output") || item.isArray("output")) && typ == "function_call_output":
		if item.isString("output") {
			return append(msgs, newObject("content", item.get("output"), "role", "tool", "tool_call_id", item.get("call_id"))), nil
		}
		outputs := item.get("output").([]any)
		for _, o := range outputs {
			part, ok := o.(*object)
			if !ok || !part.has("type") {
				return nil, status.Errorf(status.InvalidArg, "output of tool call missing 'type' field")
			}
			switch part.get("type") {
			case "input_text":
				part.set("type", "text")
			case "input_image":
				if !part.has("image_url") {
					return nil, status.Errorf(status.InvalidArg, "'image_url' is required")
				}
				part.set("type", "image_url")
				part.set("image_url", newObject("url", part.get("image_url")))
			default:
				return nil, status.Errorf(status.InvalidArg, "output of tool call should be 'Input text' or 'Input image'")
			}
		}
		return append(msgs, newObject("content", outputs, "role", "tool", "tool_call_id", item.get("call_id"))), nil
	case item.isArray("summary") && typ == "reasoning":
		content, ok := item.get("content").([]any)
		if !ok || len(content) == 0 {
			return nil, status.Errorf(status.InvalidArg, "item['content'] is not a non-empty array")
		}
		first, ok := content[0].(*object)
		if !ok || !first.isString("text") {
			return nil, status.Errorf(status.InvalidArg, "item['content']['text'] is not a string")
		}
		if mergePrev {
			prev.set("reasoning_content", first.get("text"))
			return msgs, nil
		}
		return append(msgs, newObject("role", "assistant", "content", []any{}, "reasoning_content", first.get("text"))), nil
	}
	return nil, status.Errorf(status.InvalidArg, "cannot determine type of 'item'")
}

func orEmpty(a []any) []any {
	if a == nil {
		return []any{}
	}
	return a
}

// normalizeBillingHeader is normalize_anthropic_billing_header: Claude
// Code stamps its system prompt with a per-request "cch=" value, which the
// server overwrites with f's so that the prefix stays the same.
func normalizeBillingHeader(s string) string {
	const prefix = "x-anthropic-billing-header:"
	if !strings.HasPrefix(s, prefix) {
		return s
	}
	i := strings.Index(s[len(prefix):], "cch=")
	if i < 0 {
		return s
	}
	at := len(prefix) + i + 4
	if at+5 < len(s) && s[at+5] == ';' {
		return s[:at] + "fffff" + s[at+5:]
	}
	return s
}

// messagesToChat is server_chat_convert_anthropic_to_oai.
func messagesToChat(body []byte) ([]byte, error) {
	in, err := parseObject(body)
	if err != nil {
		return nil, err
	}
	out := newObject()
	var msgs []any
	switch sys := in.get("system").(type) {
	case string:
		msgs = append(msgs, newObject("role", "system", "content", normalizeBillingHeader(sys)))
	case []any:
		var sb strings.Builder
		for _, b := range sys {
			if blk, ok := b.(*object); ok && blk.str("type") == "text" {
				sb.WriteString(normalizeBillingHeader(blk.str("text")))
			}
		}
		msgs = append(msgs, newObject("role", "system", "content", sb.String()))
	case nil:
	default:
		msgs = append(msgs, newObject("role", "system", "content", ""))
	}
	if !in.has("messages") {
		return nil, status.Errorf(status.InvalidArg, "'messages' is required")
	}
	if list, ok := in.get("messages").([]any); ok {
		for _, m := range list {
			if msgs, err = messagesItem(msgs, m); err != nil {
				return nil, err
			}
		}
	}
	if msgs == nil {
		msgs = []any{}
	}
	out.set("messages", msgs)
	if tools, ok := in.get("tools").([]any); ok {
		oai := []any{}
		for _, t := range tools {
			tool, _ := t.(*object)
			if tool == nil {
				tool = newObject()
			}
			var params any = newObject()
			if tool.has("input_schema") {
				params = tool.get("input_schema")
			}
			oai = append(oai, newObject("type", "function", "function",
				newObject("name", tool.str("name"), "description", tool.str("description"), "parameters", params)))
		}
		out.set("tools", oai)
	}
	if tc, ok := in.get("tool_choice").(*object); ok {
		switch tc.str("type") {
		case "auto":
			out.set("tool_choice", "auto")
		case "any", "tool":
			out.set("tool_choice", "required")
		}
	}
	if in.has("stop_sequences") {
		out.set("stop", in.get("stop_sequences"))
	}
	if in.has("max_tokens") {
		out.set("max_tokens", in.get("max_tokens"))
	} else {
		out.set("max_tokens", jsonInt(4096))
	}
	for _, k := range []string{"temperature", "top_p", "top_k", "stream", "chat_template_kwargs"} {
		if in.has(k) {
			out.set(k, in.get(k))
		}
	}
	if th, ok := in.get("thinking").(*object); ok && th.str("type") == "enabled" {
		budget := 10000
		if n, ok := th.get("budget_tokens").(json.Number); ok {
			if f, err := n.Float64(); err == nil && f >= math.MinInt32 && f <= math.MaxInt32 {
				budget = int(f)
			}
		}
		out.set("thinking_budget_tokens", jsonInt(budget))
	}
	if md, ok := in.get("metadata").(*object); ok && md.str("user_id") != "" {
		out.set("__metadata_user_id", md.str("user_id"))
	}
	return out.MarshalJSON()
}

// messagesItem converts one Anthropic message, appending to msgs.
func messagesItem(msgs []any, m any) ([]any, error) {
	msg, ok := m.(*object)
	if !ok {
		return append(msgs, m), nil
	}
	role := msg.str("role")
	if !msg.has("content") {
		if role == "assistant" {
			return msgs, nil
		}
		return append(msgs, msg), nil
	}
	content, ok := msg.get("content").([]any)
	if !ok {
		return append(msgs, msg), nil
	}
	var toolCalls, converted, toolResults []any
	var reasoning strings.Builder
	hasToolCalls := false
	for _, b := range content {
		blk, _ := b.(*object)
		if blk == nil {
			blk = newObject()
		}
		switch blk.str("type") {
		case "text":
			converted = append(converted, blk)
		case "thinking":
			reasoning.WriteString(blk.str("thinking"))
		case "image":
			if img := imageURL(blk); img != nil {
				converted = append(converted, img)
			}
		case "tool_use":
			var input any = newObject()
			if v := blk.get("input"); v != nil {
				input = v
			}
			args, err := dumpJSON(input)
			if err != nil {
				return nil, err
			}
			toolCalls = append(toolCalls, newObject("id", blk.str("id"), "type", "function",
				"function", newObject("name", blk.str("name"), "arguments", args)))
			hasToolCalls = true
		case "tool_result":
			id := blk.str("tool_use_id")
			switch rc := blk.get("content").(type) {
			case string:
				toolResults = append(toolResults, newObject("role", "tool", "tool_call_id", id, "content", rc))
			case []any:
				var text strings.Builder
				var parts []any
				images := false
				for _, c := range rc {
					cb, _ := c.(*object)
					if cb == nil {
						cb = newObject()
					}
					switch cb.str("type") {
					case "text":
						text.WriteString(cb.str("text"))
						parts = append(parts, newObject("type", "text", "text", cb.str("text")))
					case "image":
						images = true
						if img := imageURL(cb); img != nil {
							parts = append(parts, img)
						}
					}
				}
				if !images {
					toolResults = append(toolResults, newObject("role", "tool", "tool_call_id", id, "content", text.String()))
				} else {
					toolResults = append(toolResults, newObject("role", "tool", "tool_call_id", id, "content", orEmpty(parts)))
				}
			default:
				toolResults = append(toolResults, newObject("role", "tool", "tool_call_id", id, "content", ""))
			}
		}
	}
	if len(converted) > 0 || hasToolCalls || reasoning.Len() > 0 {
		nm := newObject("role", role)
		switch {
		case len(converted) > 0:
			nm.set("content", converted)
		default:
			nm.set("content", "")
		}
		if len(toolCalls) > 0 {
			nm.set("tool_calls", toolCalls)
		}
		if reasoning.Len() > 0 {
			nm.set("reasoning_content", reasoning.String())
		}
		msgs = append(msgs, nm)
	}
	return append(msgs, toolResults...), nil
}

// jsonInt is n as parseOrdered reads numbers.
func jsonInt(n int) json.Number { return json.Number(strconv.Itoa(n)) }

// imageURL is the chat image part of an Anthropic image block (a base64
// source becomes a data URL, JPEG unless it says otherwise); nil for a
// source of another type, which the server drops.
func imageURL(blk *object) *object {
	src, _ := blk.get("source").(*object)
	if src == nil {
		src = newObject()
	}
	switch src.str("type") {
	case "base64":
		media := "image/jpeg"
		if src.isString("media_type") {
			media = src.str("media_type")
		}
		return newObject("type", "image_url", "image_url", newObject("url", "data:"+media+";base64,"+src.str("data")))
	case "url":
		return newObject("type", "image_url", "image_url", newObject("url", src.str("url")))
	}
	return nil
}

// parseObject parses a request body that must be one JSON object, keeping
// its key order.
func parseObject(body []byte) (*object, error) {
	v, err := parseOrdered(body)
	if err != nil {
		return nil, err
	}
	in, ok := v.(*object)
	if !ok {
		return nil, status.Errorf(status.InvalidArg, "the body is not a JSON object")
	}
	return in, nil
}
