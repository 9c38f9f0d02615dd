//go:build linux && (amd64 || arm64)

package mooncake

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// The numbers are those that mooncake-capi/test/abi_test.c asserts for the C
// header; both sides must change together.
func TestLayoutMatchesHeader(t *testing.T) {
	var r cRequest
	var s cStatus
	var be cBufferEntry
	var nm cNotifyMsg
	var ms MockStats
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(transfer_request)", unsafe.Sizeof(r), 40},
		{"transfer_request.opcode", unsafe.Offsetof(r.opcode), 0},
		{"transfer_request.source", unsafe.Offsetof(r.source), 8},
		{"transfer_request.target_id", unsafe.Offsetof(r.targetID), 16},
		{"transfer_request.reserved", unsafe.Offsetof(r.reserved), 20},
		{"transfer_request.target_offset", unsafe.Offsetof(r.targetOffset), 24},
		{"transfer_request.length", unsafe.Offsetof(r.length), 32},
		{"sizeof(transfer_status)", unsafe.Sizeof(s), 16},
		{"transfer_status.status", unsafe.Offsetof(s.state), 0},
		{"transfer_status.transferred_bytes", unsafe.Offsetof(s.transferred), 8},
		{"sizeof(buffer_entry)", unsafe.Sizeof(be), 16},
		{"buffer_entry.length", unsafe.Offsetof(be.length), 8},
		{"sizeof(notify_msg)", unsafe.Sizeof(nm), 16},
		{"notify_msg.msg", unsafe.Offsetof(nm.msg), 8},
		{"sizeof(mock_te_stats)", unsafe.Sizeof(ms), 64},
		{"mock_te_stats.frames_rejected", unsafe.Offsetof(ms.FramesRejected), 56},
	} {
		assert.Equal(t, c.want, c.got, c.name)
	}
}
