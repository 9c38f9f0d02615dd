package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
)

// The end-to-end benchmark (the patched llama-server, run on its own)
// leaves its results in bench/out/e2e.json, in a schema of its own. The
// report renders any JSON object: top-level scalars as one table, each
// top-level object as a table of its (flattened) fields, each top-level
// array of objects as a table with a row per element. A top-level boolean
// named NAME_met becomes a row of the targets table, with the top-level
// value NAME, if any, as its target and NAME_measured as what was measured.

// jsonValue is a decoded JSON value that keeps its objects' key order, so
// tables come out in the order the benchmark wrote them.
type jsonValue struct {
	kind   byte // 'o' object, 'a' array, 's' scalar
	keys   []string
	fields []jsonValue
	items  []jsonValue
	scalar any // string, json.Number, bool or nil
}

// maxJSONDepth bounds nesting, so a hostile file cannot exhaust the stack.
const maxJSONDepth = 64

// decodeOrdered parses one JSON value and nothing after it.
func decodeOrdered(b []byte) (jsonValue, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := readValue(dec, 0)
	if err != nil {
		return jsonValue{}, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jsonValue{}, errors.New("trailing data after the JSON value")
	}
	return v, nil
}

func readValue(dec *json.Decoder, depth int) (jsonValue, error) {
	if depth > maxJSONDepth {
		return jsonValue{}, errors.New("JSON nested too deep")
	}
	tok, err := dec.Token()
	if err != nil {
		return jsonValue{}, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			v := jsonValue{kind: 'o'}
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return jsonValue{}, err
				}
				f, err := readValue(dec, depth+1)
				if err != nil {
					return jsonValue{}, err
				}
				v.keys = append(v.keys, k.(string))
				v.fields = append(v.fields, f)
			}
			_, err := dec.Token() // '}'
			return v, err
		case '[':
			v := jsonValue{kind: 'a'}
			for dec.More() {
				it, err := readValue(dec, depth+1)
				if err != nil {
					return jsonValue{}, err
				}
				v.items = append(v.items, it)
			}
			_, err := dec.Token() // ']'
			return v, err
		}
		return jsonValue{}, fmt.Errorf("unexpected %v", t)
	}
	return jsonValue{kind: 's', scalar: tok}, nil
}

// field returns the value of key in an object.
func (v jsonValue) field(key string) (jsonValue, bool) {
	for i, k := range v.keys {
		if k == key {
			return v.fields[i], true
		}
	}
	return jsonValue{}, false
}

// text renders a value for a table cell: scalars as themselves, numbers
// rounded for reading, containers as compact JSON-like text.
func (v jsonValue) text() string {
	switch v.kind {
	case 'o':
		parts := make([]string, len(v.keys))
		for i, k := range v.keys {
			parts[i] = k + ": " + v.fields[i].text()
		}
		return "{" + strings.Join(parts, ", ") + "}"
	case 'a':
		parts := make([]string, len(v.items))
		for i, it := range v.items {
			parts[i] = it.text()
		}
		return "[" + strings.Join(parts, ", ") + "]"
	}
	switch s := v.scalar.(type) {
	case nil:
		return "null"
	case string:
		return s
	case bool:
		return strconv.FormatBool(s)
	case json.Number:
		return roundNumber(s)
	}
	return fmt.Sprint(v.scalar)
}

// roundNumber keeps integers whole and gives fractions a few digits.
func roundNumber(n json.Number) string {
	f, err := n.Float64()
	switch {
	case err != nil || math.IsInf(f, 0):
		return n.String()
	case f == math.Trunc(f) && math.Abs(f) < 1e15:
		return strconv.FormatFloat(f, 'f', -1, 64)
	case math.Abs(f) >= 100:
		return strconv.FormatFloat(f, 'f', 1, 64)
	case math.Abs(f) >= 1:
		return strconv.FormatFloat(f, 'f', 2, 64)
	}
	return strconv.FormatFloat(f, 'g', 3, 64)
}

// flatten lists an object's scalar leaves and arrays as dotted keys.
func (v jsonValue) flatten(prefix string, keys *[]string, vals *[]string) {
	for i, k := range v.keys {
		f := v.fields[i]
		if f.kind == 'o' {
			f.flatten(prefix+k+".", keys, vals)
			continue
		}
		*keys = append(*keys, prefix+k)
		*vals = append(*vals, f.text())
	}
}

// readE2E returns the end-to-end results at path, or nil when the file
// does not exist (the end-to-end benchmark was not run).
func readE2E(path string) (json.RawMessage, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	v, err := decodeOrdered(b)
	if err != nil {
		return nil, fmt.Errorf("e2e results: %w", err)
	}
	if v.kind != 'o' {
		return nil, errors.New("e2e results: not a JSON object")
	}
	return b, nil
}

// e2eTable is one table of the end-to-end section.
type e2eTable struct {
	title string
	head  []string
	rows  [][]string
}

// e2eTables lays out a results object as tables.
func e2eTables(v jsonValue) []e2eTable {
	scalars := e2eTable{head: []string{"", ""}}
	var out []e2eTable
	for i, k := range v.keys {
		f := v.fields[i]
		switch {
		case f.kind == 'o':
			t := e2eTable{title: k, head: []string{"", ""}}
			var keys, vals []string
			f.flatten("", &keys, &vals)
			for j := range keys {
				t.rows = append(t.rows, []string{keys[j], vals[j]})
			}
			out = append(out, t)
		case f.kind == 'a' && allObjects(f.items):
			out = append(out, objectRows(k, f.items))
		default:
			scalars.rows = append(scalars.rows, []string{k, f.text()})
		}
	}
	if len(scalars.rows) > 0 {
		out = append([]e2eTable{scalars}, out...)
	}
	return out
}

func allObjects(items []jsonValue) bool {
	for _, it := range items {
		if it.kind != 'o' {
			return false
		}
	}
	return len(items) > 0
}

// objectRows makes a table of objects: a column per flattened key, in
// order of first appearance.
func objectRows(title string, items []jsonValue) e2eTable {
	t := e2eTable{title: title}
	col := map[string]int{}
	var rows []map[int]string
	for _, it := range items {
		var keys, vals []string
		it.flatten("", &keys, &vals)
		row := map[int]string{}
		for j, k := range keys {
			c, ok := col[k]
			if !ok {
				c = len(t.head)
				col[k] = c
				t.head = append(t.head, k)
			}
			row[c] = vals[j]
		}
		rows = append(rows, row)
	}
	for _, row := range rows {
		cells := make([]string, len(t.head))
		for c, s := range row {
			cells[c] = s
		}
		t.rows = append(t.rows, cells)
	}
	return t
}

// e2eTargets returns the results' NAME_met booleans as target rows:
// what, target, measured, met.
func e2eTargets(v jsonValue) [][4]string {
	var out [][4]string
	for i, k := range v.keys {
		name, ok := strings.CutSuffix(k, "_met")
		met, isBool := v.fields[i].scalar.(bool)
		if !ok || !isBool || v.fields[i].kind != 's' {
			continue
		}
		target, measured := "", "see the end-to-end section"
		if t, ok := v.field(name); ok {
			target = t.text()
		}
		if m, ok := v.field(name + "_measured"); ok {
			measured = m.text()
		}
		out = append(out, [4]string{"end-to-end: " + strings.ReplaceAll(name, "_", " "), target, measured, judge(met)})
	}
	return out
}
