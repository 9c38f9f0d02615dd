package main

import (
	"fmt"

	"github.com/mcbridge/mcbridge/internal/disk"
)

// writeDisk reports the disk tier: what each codec stores and how fast on
// real KV (BenchmarkDiskCodec), the default the tier ships with, and a
// prefix read back from the tier against memory and recompute
// (BenchmarkDiskRestore).
func (r *report) writeDisk(m *md) {
	m.p("## Disk tier\n")
	m.p("`BenchmarkDiskCodec` (bench/e2e): the KV of 2048 tokens prefilled by a stock llama-server, cut into 256-token blocks, for the bench model and for two layers shaped as Llama 3 8B's. `stored/raw` is the files' size over the blocks'; `zstd` is byte planes then zstd at its fastest level, `zstd-flat` zstd alone. Decoding is what every read back pays; encoding every spill.\n")
	var rows [][]string
	for _, b := range r.family("DiskCodec") {
		rows = append(rows, []string{b.Param("model"), b.Param("codec"), num(b.Metrics["stored/raw"], 3),
			num(b.Metrics["encode-GB/s"], 2), num(b.Metrics["decode-GB/s"], 2)})
	}
	m.table([]string{"model", "codec", "stored/raw", "encode GB/s", "decode GB/s"}, rows)
	m.p("The tier's default codec (`mcbridge serve --disk-codec`): **%s**. %s\n", disk.DefaultCodec, r.codecVerdict())

	m.p("`BenchmarkDiskRestore` (bench/e2e): the bench model's 2048-token prefix (8 blocks) read back and verified (file checksum, header, every layer's sum) as a store node does for a reader whose blocks its pool evicted; `cold` drops every file's pages (checked with mincore) before each pass. `memory` copies and verifies the same blocks from DRAM. `x recompute` is the prefill that computed the prefix, measured in the same run, over the read.\n")
	rows = nil
	for _, b := range r.family("DiskRestore") {
		from := b.Param("from")
		if c := b.Param("codec"); c != "" {
			from += " (" + c + ")"
		}
		rows = append(rows, []string{from, num(b.Metrics["ms/prefix"], 2), num(b.Metrics["MB/s"]/1e3, 2),
			num(b.Metrics["recompute-ms"], 1), num(b.Metrics["x-recompute"], 1)})
	}
	m.table([]string{"from", "ms", "GB/s", "recompute ms", "x recompute"}, rows)
}

// codecVerdict says what the bench model's figures say about zstd: the
// space it saves against the read-back speed it costs.
func (r *report) codecVerdict() string {
	var raw, z benchResult
	for _, b := range r.family("DiskCodec") {
		if b.Param("model") != "bench" {
			continue
		}
		switch b.Param("codec") {
		case "raw":
			raw = b
		case "zstd":
			z = b
		}
	}
	if raw.Metrics == nil || z.Metrics == nil || z.Metrics["decode-GB/s"] == 0 {
		return "(BenchmarkDiskCodec did not run: no figures to judge it by.)"
	}
	return fmt.Sprintf("On the bench model's KV zstd over byte planes saves %s of the bytes and decodes %sx slower than a raw read.",
		pct(1-z.Metrics["stored/raw"]), num(raw.Metrics["decode-GB/s"]/z.Metrics["decode-GB/s"], 1))
}
