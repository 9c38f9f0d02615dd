package testenv

import (
	"cmp"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/store/mooncake/mastertest"
)

// StoreNode is `mcbridge serve --mooncake-master`: a supervised
// mooncake_master, a DRAM segment, and the keeper of the swarm's store
// entries.
type StoreNode struct {
	*Server
	Master string // the master's RPC address
	Admin  string // the master's admin URL
	etcd   string
}

// StoreNodeOptions tune a node.
type StoreNodeOptions struct {
	ClientTTL    time.Duration // the master's; 0: 2 s, so that tests see a dead client dropped quickly
	SegmentBytes int64         // 0: 64 MiB
	AuditMS      int           // the node's audit interval; 0: 300
}

// StartStoreNode runs a node whose directory is the etcd at endpoint.
func StartStoreNode(tb testing.TB, name, endpoint string, o StoreNodeOptions) *StoreNode {
	tb.Helper()
	if o.ClientTTL == 0 {
		o.ClientTTL = 2 * time.Second
	}
	if o.SegmentBytes == 0 {
		o.SegmentBytes = 64 << 20
	}
	if o.AuditMS == 0 {
		o.AuditMS = 300
	}
	n := &StoreNode{Master: "127.0.0.1:" + strconv.Itoa(FreePort(tb)), etcd: endpoint}
	admin := "127.0.0.1:" + strconv.Itoa(FreePort(tb))
	n.Admin = "http://" + admin
	cfg := fmt.Sprintf(`{"directory": {"kind": "etcd", "endpoints": [%q]}, "store": {"lib": %q, "audit_interval_ms": %d}}`,
		endpoint, mastertest.Lib(tb), o.AuditMS)
	args := []string{"serve", "--mooncake-master", filepath.Join(mastertest.Dir(tb), "mooncake_master"),
		"--master-addr", n.Master, "--master-admin", admin, "--client-ttl", o.ClientTTL.String(),
		"--segment-bytes", strconv.FormatInt(o.SegmentBytes, 10), "--config", cfg}
	n.Server = StartServer(tb, name, Mcbridge(tb), args, nil, func(port int) []string {
		return []string{"--listen", "127.0.0.1:" + strconv.Itoa(port)}
	}, "/healthz")
	// The node serves before its Store client has mounted its segment (the
	// master may still be starting). A writer that put its blocks before
	// then would find one segment for two replicas, and the tests that
	// count on the node's copy would race it. mcbridge_up is 1 once the
	// client is set up, its segment mounted.
	Eventually(tb, 30*time.Second, func() bool { return Metrics(tb, n.URL+"/metrics")["mcbridge_up"] == 1 },
		"%s never mounted its segment", name)
	return n
}

// BridgeOptions shape Config.
type BridgeOptions struct {
	Replicas     int   // store.replicas (0: 1)
	SegmentBytes int64 // store.segment_bytes: what the server contributes
	DeadlineMS   int   // transfer_timeout_ms (0: 5000)
	BlockTokens  int   // block_tokens (0: 64)
}

// Config is a bridge configuration for a server of the swarm: the etcd
// directory and the node's master, with the options.
func (n *StoreNode) Config(tb testing.TB, o BridgeOptions) string {
	o.Replicas, o.DeadlineMS, o.BlockTokens = max(o.Replicas, 1), cmp.Or(o.DeadlineMS, 5000), cmp.Or(o.BlockTokens, 64)
	return fmt.Sprintf(`{"block_tokens": %d, "transfer_timeout_ms": %d, "directory": {"kind": "etcd", "endpoints": [%q]},`+
		` "store": {"kind": "mooncake", "master": %q, "lib": %q, "replicas": %d, "segment_bytes": %d, "audit_interval_ms": 300}}`,
		o.BlockTokens, o.DeadlineMS, n.etcd, n.Master, mastertest.Lib(tb), o.Replicas, o.SegmentBytes)
}

// MasterState is the node's /master.
type MasterState struct {
	Pid      int   `json:"pid"`
	Restarts int64 `json:"restarts"`
}

// MasterState reads the node's view of its master.
func (n *StoreNode) MasterState(tb testing.TB) MasterState {
	tb.Helper()
	var st MasterState
	require.NoError(tb, json.Unmarshal(Get(tb, n.URL+"/master"), &st))
	return st
}

// Keys lists the objects the master holds.
func (n *StoreNode) Keys(tb testing.TB) []string {
	tb.Helper()
	return strings.Fields(string(Get(tb, n.Admin+"/get_all_keys")))
}

// Segments lists the segments the master knows.
func (n *StoreNode) Segments(tb testing.TB) []string {
	tb.Helper()
	return strings.Fields(string(Get(tb, n.Admin+"/get_all_segments")))
}
