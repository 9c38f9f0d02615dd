package main

import (
	"fmt"
	"math"
	"strings"
)

// The Mooncake Store section: BenchmarkStore (internal/store/mooncake)
// moves 48 MiB as objects through a real mooncake_master and two client
// processes, beside a memcpy of the same bytes in the same run;
// BenchmarkStoreTTFT (bench/e2e) times llama-servers restoring a prefix
// another process computed, through the store and over the direct
// Transfer Engine path.

// storeShapes are BenchmarkStore's and BenchmarkPeerRead's shapes, in the
// order the table shows them.
var storeShapes = []string{"prefix48MiB", "blocks1MiB", "blocks16MiB"}

// storeOp splits a BenchmarkStore result into its operation
// ("get/remote", "put/registered/replicas=2", ...) and its shape.
func storeOp(b benchResult) (op, shape string) {
	name := strings.TrimPrefix(b.Name, "Store/")
	i := strings.LastIndexByte(name, '/')
	if i < 0 {
		return name, ""
	}
	return name[:i], name[i+1:]
}

// throughputCell is a row's GB/s and, where measured, its ratio to memcpy.
func throughputCell(b benchResult) string {
	gbps := num(b.Metrics["MB/s"]/1e3, 2) + " GB/s"
	if x, ok := b.Metrics["x_memcpy"]; ok {
		return fmt.Sprintf("%s, %s x memcpy", gbps, num(x, 2))
	}
	return gbps
}

// storeRestoreTarget judges docs/design.md §15's restore throughput target
// on the store's gets: from another process's segment against 0.8 x
// memcpy, from a replica in the reader's own segment against 0.9 x. Every
// shape's objects are at least 1 MiB.
func (r *report) storeRestoreTarget() (measured, verdict string) {
	worst := map[string]float64{"get/remote": math.Inf(1), "get/own-replica": math.Inf(1)}
	at := map[string]string{}
	for _, b := range r.family("Store") {
		op, shape := storeOp(b)
		if w, ok := worst[op]; ok && b.Metrics["x_memcpy"] < w {
			worst[op], at[op] = b.Metrics["x_memcpy"], shape
		}
	}
	remote, own := worst["get/remote"], worst["get/own-replica"]
	if math.IsInf(remote, 1) || math.IsInf(own, 1) {
		return "BenchmarkStore did not run", notMeasured
	}
	return fmt.Sprintf("%s x at worst from another process's segment (%s), %s x from a replica in the own segment (%s)",
		num(remote, 2), at["get/remote"], num(own, 2), at["get/own-replica"]), judge(remote >= 0.8 && own >= 0.9)
}

// shapeRow is a throughput row, a cell per shape; found says whether a
// shape had a result.
func shapeRow(label string, result func(shape string) (benchResult, bool)) (row []string, found bool) {
	row = []string{label}
	for _, sh := range storeShapes {
		c := ""
		if b, ok := result(sh); ok {
			c, found = throughputCell(b), true
		}
		row = append(row, c)
	}
	return row, found
}

func (r *report) writeStore(m *md) {
	m.p("## Mooncake Store\n")
	m.p("`BenchmarkStore` (internal/store/mooncake): 48 MiB moved through a real `mooncake_master` as objects of one size (`prefix48MiB`: 16 objects of 3 MiB, the bench model's 256-token blocks; or 48 of 1 MiB, 3 of 16 MiB), between this process and a second client process holding a segment, over the store's TCP transport on loopback. `get/remote` is `batch_get_into` of objects whose only replica is in the other process's segment; `get/own-replica` of objects with a second replica in the reader's own segment. `put/registered` is `batch_put_from` out of registered memory, `put/copying` is `put`, which copies through the library's staging buffer; `replicas=1-own` places the one replica in the writer's segment, `1-other` in the other process's, `2` in both. Before they are timed, gets are checked byte for byte and puts where their replicas landed and by reading them back. `x memcpy` divides by the `memcpy` row, a copy of the same objects in the same run. The last row is the direct Transfer Engine path (`BenchmarkPeerRead`, the real library over TCP, no store), against its own run's memcpy.\n")
	var rows [][]string
	var ops []string
	cell := map[[2]string]benchResult{}
	for _, b := range r.family("Store") {
		op, shape := storeOp(b)
		if !contains(ops, op) {
			ops = append(ops, op)
		}
		cell[[2]string{op, shape}] = b
	}
	for _, op := range ops {
		row, _ := shapeRow("`"+op+"`", func(sh string) (benchResult, bool) { b, ok := cell[[2]string{op, sh}]; return b, ok })
		rows = append(rows, row)
	}
	te, teRan := shapeRow("Transfer Engine, direct (`PeerRead` real-tcp)", func(sh string) (benchResult, bool) {
		return r.bench("PeerRead/way=real-tcp/shape=" + sh)
	})
	if len(rows) > 0 && teRan {
		rows = append(rows, te)
	}
	m.table(append([]string{"operation"}, storeShapes...), rows)
	measured, verdict := r.storeRestoreTarget()
	m.p("Restore throughput target (docs/design.md §15: >= 0.8 x memcpy from a peer process, >= 0.9 x from the own pool): %s; %s.\n", measured, verdict)

	m.p("`BenchmarkStoreTTFT` (bench/e2e): time to first token, in ms, of a prompt whose shared prefix another patched llama-server process computed, then 64 tokens of its own: restored through Mooncake Store (the prefix's one replica in the computing server's segment, the reader a pure client), restored over the direct Transfer Engine path (etcd directory, the real library, no store), computed by a stock server, and the stock server's own slot holding the prefix and computing the 64 tokens alone. `x faster` is stock over through the store; `store / TE` the store's TTFT over the direct path's. One pass of each, in one run.\n")
	rows = nil
	if b, ok := r.bench("StoreTTFT"); ok {
		for _, n := range []string{"4096", "8192"} {
			if _, ok := b.Metrics["ttft-ms-store-"+n]; !ok {
				continue
			}
			rows = append(rows, []string{n, num(b.Metrics["ttft-ms-without-"+n], 0), num(b.Metrics["ttft-ms-store-"+n], 0),
				num(b.Metrics["ttft-ms-te-"+n], 0), num(b.Metrics["ttft-ms-local-"+n], 0),
				num(b.Metrics["x-faster-store-"+n], 1), num(b.Metrics["store/te-"+n], 2)})
		}
	}
	if len(rows) == 0 {
		m.p("BenchmarkStoreTTFT did not run.\n")
		return
	}
	m.table([]string{"shared tokens", "stock", "through the store", "direct TE", "stock, prefix in its slot", "x faster", "store / TE"}, rows)
}
