package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// The device-KV benchmarks (bench/e2e, ggml's RPC backend as the device):
// BenchmarkDeviceRestore against stock and llama-server's slot restore on
// the same device, BenchmarkDeviceStall's layer-wise pipeline at link
// speeds.

const (
	deviceCutWhat     = "device KV (RPC): TTFT across processes"
	deviceCutTarget   = ">= the slot-restore path's cut on the same device"
	deviceRateWhat    = "device KV (RPC): restore throughput"
	deviceRateTarget  = ">= 0.9 x the backend's own tensor_set of the same bytes (llama-server's slot restore on the same device)"
	deviceStallWhat   = "device KV (RPC): layer-wise load stall"
	deviceStallTarget = "<= one layer's time of the slower stage at 1-25 GB/s: a restore into device KV beyond the slower of the same restore into host KV (the link) and the device's own tensor_set of the bytes"
)

// deviceTargets judges the device benchmarks against docs/design.md §15.
func (r *report) deviceTargets() [][4]string {
	var rows [][4]string
	if b, ok := r.bench("DeviceRestore"); ok {
		m := b.Metrics
		rows = append(rows,
			[4]string{deviceCutWhat, deviceCutTarget,
				fmt.Sprintf("stock %s ms, slot restore %s ms, restored %s ms: cut %s x, %s x the slot restore's TTFT",
					num(m["stock_ttft_ms"], 1), num(m["slot_ttft_ms"], 1), num(m["restored_ttft_ms"], 1), num(m["ttft_cut_x"], 2), num(m["vs_slot_ttft_x"], 2)),
				judge(m["vs_slot_ttft_x"] >= 1)},
			[4]string{deviceRateWhat, deviceRateTarget,
				fmt.Sprintf("%s x (%s GB/s against %s GB/s)", num(m["restore_vs_tensor_set_x"], 2), num(m["restore_GB/s"], 2), num(m["slot_restore_GB/s"], 2)),
				judge(m["restore_vs_tensor_set_x"] >= 0.9)})
	} else {
		rows = append(rows, [4]string{deviceCutWhat, deviceCutTarget, "BenchmarkDeviceRestore did not run", notMeasured},
			[4]string{deviceRateWhat, deviceRateTarget, "BenchmarkDeviceRestore did not run", notMeasured})
	}
	if b, ok := r.bench("DeviceStall"); ok {
		measured, met := deviceStalls(b.Metrics, r.tensorSetGBps())
		rows = append(rows, [4]string{deviceStallWhat, deviceStallTarget, measured, judge(met)})
	} else {
		rows = append(rows, [4]string{deviceStallWhat, deviceStallTarget, "BenchmarkDeviceStall did not run", notMeasured})
	}
	return rows
}

// tensorSetGBps is the device's own tensor_set rate this run measured
// (llama-server's slot restore into it), 0 where it did not.
func (r *report) tensorSetGBps() float64 {
	b, _ := r.bench("DeviceRestore")
	return b.Metrics["slot_restore_GB/s"]
}

// stallLinks are the shaped links BenchmarkDeviceStall reported, in GB/s,
// slowest first.
func stallLinks(metrics map[string]float64) []int {
	var links []int
	for k := range metrics {
		if s, ok := strings.CutPrefix(k, "stall_layers-"); ok {
			if gbps, err := strconv.Atoi(strings.TrimSuffix(s, "GBps")); err == nil {
				links = append(links, gbps)
			}
		}
	}
	sort.Ints(links)
	return links
}

// deviceStalls says the stall at each link, in layers of the slower
// stage: the link's time for a layer, or the device's own tensor_set of a
// layer at tensorSet GB/s (BenchmarkDeviceRestore's slot restore, this
// run; 0 when it did not run, and then the link's alone). Met where every
// one is at most one layer.
func deviceStalls(metrics map[string]float64, tensorSet float64) (string, bool) {
	links := stallLinks(metrics)
	met := len(links) > 0
	var parts []string
	for _, gbps := range links {
		stall, stage := pipelineStall(metrics, gbps, tensorSet)
		met = met && stall <= 1
		parts = append(parts, fmt.Sprintf("%d GB/s: %s layers of the %s", gbps, num(stall, 2), stage))
	}
	if len(parts) == 0 {
		return "no stall reported", false
	}
	return strings.Join(parts, "; "), met
}

// pipelineStall is what a restore into device KV over a link of gbps took
// beyond the slower of its two stages (the host-KV restore over the same
// link, and the device's tensor_set of the same bytes), in layers of that
// stage, and which stage it was.
func pipelineStall(metrics map[string]float64, gbps int, tensorSet float64) (float64, string) {
	l := fmt.Sprintf("%dGBps", gbps)
	layers := metrics["layers"]
	dev, host := metrics["device_restore_ms-"+l], metrics["host_restore_ms-"+l]
	slow, stage := host, "link"
	if tensorSet > 0 && layers > 0 {
		if upload := metrics["prefix_bytes"] / tensorSet / 1e6; upload > slow {
			slow, stage = upload, "device's tensor_set"
		}
	}
	if stage == "link" {
		return metrics["stall_layers-"+l], "link"
	}
	return (dev - slow) / (slow / layers), stage
}

func (r *report) writeDevice(m *md) {
	m.p("## Device KV (ggml's RPC backend)\n")
	m.p("The device is ggml's RPC backend: every llama-server below puts its layers and KV (`-ngl 99`) on an rpc-server of its own, another process reached through a TCP socket, so only the ratios mean anything. `BenchmarkDeviceRestore` (bench/e2e): a 1024-token prefix computed by a device-KV holder and restored by another device-KV process (etcd, the mock Transfer Engine), against stock computing the prompt on the same device and against llama-server's slot restore of the same prefix into that device (which writes the bytes with the backend's `tensor_set`); medians of 3 rounds.\n")
	if b, ok := r.bench("DeviceRestore"); ok {
		x := b.Metrics
		m.table([]string{"stock TTFT ms", "slot restore + TTFT ms", "restored TTFT ms", "cut", "x slot path", "restore GB/s", "slot restore GB/s", "x tensor_set", "same restore into host KV GB/s"},
			[][]string{{num(x["stock_ttft_ms"], 1), num(x["slot_ttft_ms"], 1), num(x["restored_ttft_ms"], 1), num(x["ttft_cut_x"], 2),
				num(x["vs_slot_ttft_x"], 2), num(x["restore_GB/s"], 2), num(x["slot_restore_GB/s"], 2), num(x["restore_vs_tensor_set_x"], 2), num(x["host_kv_restore_GB/s"], 2)}})
		m.p("The holder's save of the prompt's blocks (it runs on the server's loop before the next batch; from device KV it includes the downloads): %s ms from device KV against %s ms from host KV, where the prompt took %s ms to compute on the device.\n",
			num(x["device_save_ms"], 1), num(x["host_save_ms"], 1), num(x["device_prompt_ms"], 1))
	} else {
		m.p("BenchmarkDeviceRestore did not run.\n")
	}
	m.p("`BenchmarkDeviceStall` (bench/e2e): the bench model's prefix (4096 tokens, 12 layers) restored from a host-KV holder by readers whose mock engine carries every transfer as one link of the given speed (`MOCK_TE_LINK_MBPS`), at each speed one reader with device KV and one with host KV, interleaved. Both move and verify the same bytes; the device restore also uploads each verified layer while later layers arrive. The device restore's stages are the link (the host-KV restore over it) and the device's upload (its own `tensor_set` of the bytes, at the slot restore's rate above; that rate also reads the slot file, so it makes the upload's time an upper bound and the stall beyond it a lower bound); with the upload overlapped, it takes the slower stage plus about one layer of it. The table gives what it takes beyond the host restore (in layers of the link's time for one layer) and beyond the slower stage (in layers of it); the unshaped row is the mock's same-host copy. On this machine both stages are CPU work on the same two cores: the restore's copy and checksum, and the RPC device's upload (the client's socket writes, the rpc-server's copy into its buffer). They can overlap only as far as the cores allow, where a GPU's upload is its DMA engine's.\n")
	if b, ok := r.bench("DeviceStall"); ok {
		x := b.Metrics
		rows := [][]string{{"unshaped", num(x["host_restore_ms-unshaped"], 1), num(x["device_restore_ms-unshaped"], 1),
			num(x["device_restore_ms-unshaped"]-x["host_restore_ms-unshaped"], 1), "-", "-", "-", num(x["device_GB/s-unshaped"], 2)}}
		for _, gbps := range stallLinks(x) {
			l := fmt.Sprintf("%dGBps", gbps)
			stall, stage := pipelineStall(x, gbps, r.tensorSetGBps())
			rows = append(rows, []string{strconv.Itoa(gbps), num(x["host_restore_ms-"+l], 1), num(x["device_restore_ms-"+l], 1),
				num(x["device_restore_ms-"+l]-x["host_restore_ms-"+l], 1), num(x["stall_layers-"+l], 2), stage, num(stall, 2), num(x["device_GB/s-"+l], 2)})
		}
		m.table([]string{"link GB/s", "host KV restore ms", "device KV restore ms", "beyond host KV ms", "in layers at the link", "slower stage", "beyond it, layers of it", "device restore GB/s"}, rows)
	} else {
		m.p("BenchmarkDeviceStall did not run.\n")
	}
}
