//go:build linux && (amd64 || arm64)

package mooncake

import (
	"github.com/mcbridge/mcbridge/internal/status"
)

// convention says how a C function reports failure.
type convention int

const (
	// plain functions return a value, not a code (pointers, batch ids, void).
	plain convention = iota
	// statusCode functions return 0 or a positive Status code.
	statusCode
	// negativeCode functions return a value >= 0 or a negative code.
	negativeCode
)

// notImplementedNegative is how int-returning calls spell Status code 999.
const notImplementedNegative = -303

// teCode describes one Transfer Engine result code, by its positive value.
type teCode struct {
	status status.Code
	text   string
}

var teCodes = map[int32]teCode{
	1:   {status.InvalidArg, "invalid argument"},
	2:   {status.InvalidArg, "batch capacity exceeded"},
	3:   {status.InvalidArg, "address not registered"},
	4:   {status.State, "batch busy: a task is not yet seen finished"},
	6:   {status.Unsupported, "device not found"},
	7:   {status.InvalidArg, "address overlaps a registered region"},
	8:   {status.Unsupported, "transport not supported or not installed"},
	101: {status.Transfer, "DNS lookup failed"},
	102: {status.Transfer, "socket error"},
	103: {status.Transfer, "malformed metadata"},
	104: {status.Transfer, "handshake rejected"},
	200: {status.Transfer, "metadata error"},
	201: {status.Transfer, "endpoint error"},
	202: {status.Transfer, "context error"},
	300: {status.Transfer, "NUMA error"},
	301: {status.Transfer, "clock error"},
	302: {status.Transfer, "out of memory"},
	999: {status.Unsupported, "not implemented"},
}

// codeError turns a failed call's raw result into a bridge error. raw is the
// code as the function returned it, in either convention.
func codeError(op string, conv convention, raw int32) error {
	code := raw
	if conv == negativeCode {
		code = -raw
		if raw == notImplementedNegative {
			code = 999
		}
	}
	if c, ok := teCodes[code]; ok {
		return status.Errorf(c.status, "%s: %s (Transfer Engine code %d)", op, c.text, raw)
	}
	return status.Errorf(status.Transfer, "%s failed with Transfer Engine code %d", op, raw)
}
