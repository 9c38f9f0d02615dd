//go:build linux && (amd64 || arm64)

package mooncake

import (
	"unsafe"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Fault is a fault the mock Transfer Engine injects into the transfers an
// engine initiates (enum mock_te_fault in mooncake-capi/mock/mock_te.h).
type Fault int32

const (
	FaultNone       Fault = 0 // switch every fault off
	FaultFailAfter  Fault = 1 // arg more bytes succeed, then tasks fail
	FaultDelay      Fault = 2 // sleep arg microseconds before each slice
	FaultCorrupt    Fault = 3 // flip one delivered byte in each of the next arg tasks
	FaultDrop       Fault = 4 // arg 1: close and refuse every peer connection
	FaultStallAfter Fault = 5 // hold the workers once arg more bytes moved
	FaultVMEPERM    Fault = 6 // arg 1: same-host copies fail as under Yama ptrace_scope
)

// Path is the mock's data path (enum mock_te_path).
type Path int32

const (
	PathAuto Path = 0 // process_vm_readv/writev on the same host, else TCP
	PathTCP  Path = 1
	PathVM   Path = 2 // same-host copies only, no fallback
)

// MockStats are the mock's counters (struct mock_te_stats).
type MockStats struct {
	VMBytes           uint64
	TCPBytes          uint64
	VMFallbacks       uint64
	TasksCompleted    uint64
	TasksFailed       uint64
	InvalidBatchCalls uint64
	FramesServed      uint64
	FramesRejected    uint64
}

// IsMock reports whether the engine runs on the mock Transfer Engine.
func (e *Engine) IsMock() bool { return e.lib.sym.mockSetFault != 0 }

// SetFault arms (arg >= 0) or disarms (arg < 0) a fault; mock only.
func (e *Engine) SetFault(f Fault, arg int64) error {
	return e.use("mock_te_set_fault", func(h uintptr) error {
		_, err := e.lib.call("mock_te_set_fault", e.lib.sym.mockSetFault, negativeCode, h, uintptr(f), uintptr(arg))
		return err
	})
}

// SetPath selects the data path; mock only.
func (e *Engine) SetPath(p Path) error {
	return e.use("mock_te_set_path", func(h uintptr) error {
		_, err := e.lib.call("mock_te_set_path", e.lib.sym.mockSetPath, negativeCode, h, uintptr(p))
		return err
	})
}

// MockStats reads the mock's counters; mock only.
func (e *Engine) MockStats() (MockStats, error) {
	out := new(MockStats)
	err := e.use("mock_te_get_stats", func(h uintptr) error {
		_, err := e.lib.call("mock_te_get_stats", e.lib.sym.mockGetStats, negativeCode,
			h, uintptr(unsafe.Pointer(out)), unsafe.Sizeof(*out))
		return err
	})
	if err != nil && status.Of(err) == status.Unsupported {
		return MockStats{}, status.Errorf(status.Unsupported, "%s is not the mock Transfer Engine", e.lib.path)
	}
	return *out, err
}
