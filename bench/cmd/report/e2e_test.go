package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const sampleE2E = `{
  "date": "2026-11-29T19:11:51Z",
  "cpus": 2,
  "ttft": [
    {"shared_tokens": 1024, "ratio": 59.31554171576053, "agent": {"ttft_ms": 9009.503}, "identical": true},
    {"shared_tokens": 4096, "ratio": 59.4, "extra": null}
  ],
  "target": {"shared_tokens": 8192, "ratio_at_least": 10},
  "target_met": true,
  "slot_met": "yes"
}`

func TestE2ETables(t *testing.T) {
	v, err := decodeOrdered([]byte(sampleE2E))
	if err != nil {
		t.Fatal(err)
	}
	got := e2eTables(v)
	want := []e2eTable{
		{head: []string{"", ""}, rows: [][]string{{"date", "2026-11-29T19:11:51Z"}, {"cpus", "2"}, {"target_met", "true"}, {"slot_met", "yes"}}},
		{title: "ttft", head: []string{"shared_tokens", "ratio", "agent.ttft_ms", "identical", "extra"},
			rows: [][]string{{"1024", "59.32", "9009.5", "true", ""}, {"4096", "59.40", "", "", "null"}}},
		{title: "target", head: []string{"", ""}, rows: [][]string{{"shared_tokens", "8192"}, {"ratio_at_least", "10"}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
	targets := e2eTargets(v)
	if len(targets) != 1 || targets[0][0] != "end-to-end: target" || targets[0][1] != "{shared_tokens: 8192, ratio_at_least: 10}" || targets[0][3] != met {
		t.Fatalf("targets %q", targets)
	}
}

func TestReadE2E(t *testing.T) {
	dir := t.TempDir()
	if d, err := readE2E(filepath.Join(dir, "absent.json")); d != nil || err != nil {
		t.Fatalf("absent file: %s, %v", d, err)
	}
	for _, tc := range []struct {
		name, doc string
		ok        bool
	}{
		{"sample", sampleE2E, true},
		{"empty object", `{}`, true},
		{"array", `[1, 2]`, false},
		{"trailing data", `{} {}`, false},
		{"truncated", `{"a": [1, 2`, false},
		{"not JSON", `summary: s`, false},
		{"too deep", strings.Repeat("[", 100) + strings.Repeat("]", 100), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name+".json")
			if err := os.WriteFile(p, []byte(tc.doc), 0o644); err != nil {
				t.Fatal(err)
			}
			d, err := readE2E(p)
			if (err == nil) != tc.ok || (tc.ok && d == nil) {
				t.Fatalf("readE2E = %s, %v", d, err)
			}
		})
	}
}

func FuzzDecodeOrdered(f *testing.F) {
	f.Add([]byte(sampleE2E))
	f.Add([]byte(`{"a":{"b":[{"c":1e400}]},"d_met":false}`))
	f.Add([]byte(`[[[]]]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := decodeOrdered(b)
		if err != nil || v.kind != 'o' {
			return
		}
		for _, tb := range e2eTables(v) {
			for _, r := range tb.rows {
				if len(r) != len(tb.head) {
					t.Fatalf("ragged table %+v", tb)
				}
			}
		}
		_ = e2eTargets(v)
	})
}
