package mooncake

import (
	"errors"

	"github.com/mcbridge/mcbridge/internal/status"
)

// Mooncake Store's error codes (enum class ErrorCode, mooncake-store
// include/types.h), as the C API returns them: negative.
const (
	CodeInternal         = -1 // also: a NULL argument, or a C++ exception caught at the C boundary
	CodeNoSpace          = -200
	CodeInvalidParams    = -600
	CodeReplicaNotReady  = -703
	CodeNotFound         = -704
	CodeAlreadyExists    = -705
	CodeHasLease         = -706
	CodeTransferFailed   = -800
	CodeChecksumMismatch = -801
	CodeRPCFailed        = -900
	CodeRPCTimeout       = -901
)

type storeCode struct {
	status status.Code
	text   string
}

var storeCodes = map[int64]storeCode{
	CodeInternal:         {status.Internal, "internal error, a NULL argument or an exception in the library"},
	-10:                  {status.InvalidArg, "buffer overflow"},
	-101:                 {status.Transfer, "segment not found"},
	-102:                 {status.State, "segment already exists"},
	-103:                 {status.Transfer, "client not found by the master"},
	CodeNoSpace:          {status.PoolFull, "no space: the store is full"},
	-400:                 {status.InvalidArg, "invalid key"},
	-500:                 {status.Transfer, "write failed"},
	CodeInvalidParams:    {status.InvalidArg, "invalid parameters"},
	-601:                 {status.State, "illegal client"},
	-700:                 {status.State, "invalid write"},
	-701:                 {status.State, "invalid read"},
	-702:                 {status.Transfer, "invalid replica"},
	CodeReplicaNotReady:  {status.NotFound, "replica not ready: a put is still in progress"},
	CodeNotFound:         {status.NotFound, "object not found"},
	CodeAlreadyExists:    {status.State, "object already exists"},
	CodeHasLease:         {status.State, "object is leased (read in the last lease period)"},
	-707:                 {status.Timeout, "lease expired before the transfer completed"},
	-710:                 {status.NotFound, "replica not found"},
	-712:                 {status.NotFound, "replica is gone"},
	-714:                 {status.State, "object replicas are busy"},
	CodeTransferFailed:   {status.Transfer, "transfer failed: the segment holding the replica did not answer"},
	CodeChecksumMismatch: {status.Corrupt, "checksum mismatch"},
	CodeRPCFailed:        {status.Transfer, "RPC to the master failed: the master is unreachable"},
	CodeRPCTimeout:       {status.Timeout, "RPC to the master timed out"},
	-1010:                {status.State, "unavailable in the current status"},
	-1011:                {status.Unsupported, "unavailable in the current mode"},
	-1012:                {status.Unsupported, "not supported"},
}

// codeError turns a negative result into a bridge error.
func codeError(op string, code int64) error {
	if c, ok := storeCodes[code]; ok {
		return &Error{Op: op, Code: code, err: status.Errorf(c.status, "%s: %s (Mooncake Store code %d)", op, c.text, code)}
	}
	return &Error{Op: op, Code: code, err: status.Errorf(status.Transfer, "%s failed with Mooncake Store code %d", op, code)}
}

// Error is a failed call with the library's own code, for callers that
// tell a missing key from a full store or a master that is down.
type Error struct {
	Op   string
	Code int64 // negative, as the library returned it
	err  error
}

func (e *Error) Error() string { return e.err.Error() }
func (e *Error) Unwrap() error { return e.err }

// Code is the library's code behind err: 0 when err is nil, CodeInternal
// when err carries none.
func Code(err error) int64 {
	if err == nil {
		return 0
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return CodeInternal
}
