package proxy

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/mcbridge/mcbridge/internal/status"
)

// llama-server v0.5.0 converts /v1/responses and /v1/messages bodies into
// chat completions with nlohmann's ordered_json (common/json.cpp): objects
// keep their keys in insertion order, and chat templates that print JSON
// (tool schemas, tool call arguments) print it in that order. The proxy
// repeats the conversion to find the prompt's tokens, so it keeps JSON the
// same way: a value is nil, bool, json.Number, string, []any or *object.

// object is a JSON object that keeps its keys in insertion order.
type object struct {
	keys []string
	vals map[string]any
}

func newObject(kv ...any) *object {
	o := &object{vals: map[string]any{}}
	for i := 0; i+1 < len(kv); i += 2 {
		o.set(kv[i].(string), kv[i+1])
	}
	return o
}

func (o *object) has(k string) bool { _, ok := o.vals[k]; return ok }

func (o *object) get(k string) any { return o.vals[k] }

// set replaces a key's value where it is, or appends the key.
func (o *object) set(k string, v any) {
	if _, ok := o.vals[k]; !ok {
		o.keys = append(o.keys, k)
	}
	o.vals[k] = v
}

func (o *object) del(k string) {
	if _, ok := o.vals[k]; !ok {
		return
	}
	delete(o.vals, k)
	for i, kk := range o.keys {
		if kk == k {
			o.keys = append(o.keys[:i], o.keys[i+1:]...)
			return
		}
	}
}

// clone copies o deeply, as nlohmann's copy does.
func (o *object) clone() *object {
	c := &object{keys: append([]string(nil), o.keys...), vals: make(map[string]any, len(o.vals))}
	for k, v := range o.vals {
		c.vals[k] = cloneValue(v)
	}
	return c
}

func cloneValue(v any) any {
	switch v := v.(type) {
	case *object:
		return v.clone()
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = cloneValue(e)
		}
		return out
	}
	return v
}

// str is json_value(o, k, std::string()): the string at k, else "".
func (o *object) str(k string) string {
	s, _ := o.vals[k].(string)
	return s
}

func (o *object) isString(k string) bool { _, ok := o.vals[k].(string); return ok }

func (o *object) isArray(k string) bool { _, ok := o.vals[k].([]any); return ok }

// MarshalJSON writes the keys in order, strings without HTML escaping.
func (o *object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	if err := writeValue(&b, o, false); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// maxJSONDepth bounds nesting, so a hostile body cannot exhaust the stack.
const maxJSONDepth = 256

// parseOrdered reads one JSON value keeping object key order; a repeated
// key keeps its first position and its last value, as nlohmann does.
func parseOrdered(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := readOrdered(dec, 0)
	if err != nil {
		return nil, status.Wrap(status.InvalidArg, err, "reading JSON")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, status.Errorf(status.InvalidArg, "trailing data after the JSON value")
	}
	return v, nil
}

func readOrdered(dec *json.Decoder, depth int) (any, error) {
	if depth > maxJSONDepth {
		return nil, status.Errorf(status.InvalidArg, "JSON nested deeper than %d", maxJSONDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return tok, nil
	}
	switch d {
	case '{':
		o := newObject()
		for dec.More() {
			k, err := dec.Token()
			if err != nil {
				return nil, err
			}
			v, err := readOrdered(dec, depth+1)
			if err != nil {
				return nil, err
			}
			o.set(k.(string), v)
		}
		_, err := dec.Token()
		return o, err
	case '[':
		a := []any{}
		for dec.More() {
			v, err := readOrdered(dec, depth+1)
			if err != nil {
				return nil, err
			}
			a = append(a, v)
		}
		_, err := dec.Token()
		return a, err
	}
	return nil, status.Errorf(status.InvalidArg, "unexpected %v", d)
}

// dumpJSON is nlohmann's dump() of a value: compact, keys in order, UTF-8
// as it is, floats in its shortest form (with ".0" when integral).
func dumpJSON(v any) (string, error) {
	var b bytes.Buffer
	if err := writeValue(&b, v, true); err != nil {
		return "", err
	}
	return b.String(), nil
}

// writeValue writes v compactly. nlohmann numbers integers as they were
// written and re-prints floats; Marshal keeps them as the client wrote them.
func writeValue(b *bytes.Buffer, v any, nlohmann bool) error {
	switch v := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case json.Number:
		if !nlohmann {
			b.WriteString(string(v))
			return nil
		}
		s, err := nlohmannNumber(string(v))
		if err != nil {
			return err
		}
		b.WriteString(s)
	case string:
		writeString(b, v)
	case []any:
		b.WriteByte('[')
		for i, e := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			if err := writeValue(b, e, nlohmann); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case *object:
		b.WriteByte('{')
		for i, k := range v.keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeString(b, k)
			b.WriteByte(':')
			if err := writeValue(b, v.vals[k], nlohmann); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	case json.RawMessage:
		b.Write(v)
	default:
		return status.Errorf(status.Internal, "writing JSON of a %T", v)
	}
	return nil
}

// writeString escapes as nlohmann does: quote, backslash and control
// characters only (\b \f \n \r \t, else \u00xx), invalid UTF-8 refused by
// its parser before it gets here.
func writeString(b *bytes.Buffer, s string) {
	b.WriteByte('"')
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '"':
			b.WriteString(`\"`)
		case c == '\\':
			b.WriteString(`\\`)
		case c == '\b':
			b.WriteString(`\b`)
		case c == '\f':
			b.WriteString(`\f`)
		case c == '\n':
			b.WriteString(`\n`)
		case c == '\r':
			b.WriteString(`\r`)
		case c == '\t':
			b.WriteString(`\t`)
		case c < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte("0123456789abcdef"[c>>4])
			b.WriteByte("0123456789abcdef"[c&15])
		case c < utf8.RuneSelf:
			b.WriteByte(c)
		default:
			_, n := utf8.DecodeRuneInString(s[i:])
			b.WriteString(s[i : i+n])
			i += n
			continue
		}
		i++
	}
	b.WriteByte('"')
}

// nlohmannNumber prints a number as nlohmann's dump does: integers that fit
// 64 bits as integers, anything else as the double's shortest digits, in
// fixed notation for decimal exponents in (-4, 15] (integral values with
// ".0"), else as d.ddde±XX.
func nlohmannNumber(s string) (string, error) {
	if !strings.ContainsAny(s, ".eE") {
		if _, err := strconv.ParseInt(s, 10, 64); err == nil {
			return s, nil
		}
		if _, err := strconv.ParseUint(s, 10, 64); err == nil {
			return s, nil
		}
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) {
		return "", status.Errorf(status.InvalidArg, "number %q", s)
	}
	if f == 0 {
		if math.Signbit(f) {
			return "-0.0", nil
		}
		return "0.0", nil
	}
	neg := f < 0
	e := strconv.FormatFloat(math.Abs(f), 'e', -1, 64) // d.ddde±XX
	mant, exp, _ := strings.Cut(e, "e")
	digits := strings.Replace(mant, ".", "", 1)
	x, _ := strconv.Atoi(exp)
	// digits·10^(n-k): n is where the decimal point goes.
	k, n := len(digits), x+1
	var out string
	switch {
	case k <= n && n <= 15:
		out = digits + strings.Repeat("0", n-k) + ".0"
	case 0 < n && n <= 15:
		out = digits[:n] + "." + digits[n:]
	case -4 < n && n <= 0:
		out = "0." + strings.Repeat("0", -n) + digits
	default:
		m := digits[:1]
		if k > 1 {
			m += "." + digits[1:]
		}
		x = n - 1
		sign := "+"
		if x < 0 {
			sign, x = "-", -x
		}
		out = m + "e" + sign + strconv.Itoa(x/10) + strconv.Itoa(x%10)
		if x >= 100 {
			out = m + "e" + sign + strconv.Itoa(x)
		}
	}
	if neg {
		out = "-" + out
	}
	return out, nil
}
