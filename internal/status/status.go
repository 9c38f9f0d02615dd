// Package status defines the bridge's error codes. The numeric values are
// part of the C ABI (enum mcb_status in include/mcbridge.h) and never change.
package status

import (
	"errors"
	"fmt"
)

// Code is a bridge status. Zero is success.
type Code int32

const (
	OK            Code = 0
	InvalidArg    Code = 1  // a NULL, out-of-range or malformed argument
	BadHandle     Code = 2  // an unknown, closed or wrong-kind handle
	Config        Code = 3  // the configuration cannot be parsed or used
	ModelMismatch Code = 4  // the model or its KV format differs from the registered one
	Layout        Code = 5  // a KV layout that does not fit the model or the cells
	State         Code = 6  // a call out of order (wait after end, save after close)
	NotFound      Code = 7  // nothing to restore for these tokens
	Transfer      Code = 8  // the transport failed: peer gone, request failed
	Corrupt       Code = 9  // a block failed verification: checksum, key, tokens or generation
	Timeout       Code = 10 // a transfer or directory call ran past its deadline
	PoolFull      Code = 11 // no room in the pool even after eviction
	Directory     Code = 12 // the directory is unreachable or refused the call
	Unsupported   Code = 13 // valid but not supported by this build or transport
	Internal      Code = 14 // a bug: a recovered panic or a broken invariant
)

var names = [...]string{
	OK:            "ok",
	InvalidArg:    "invalid argument",
	BadHandle:     "bad handle",
	Config:        "bad configuration",
	ModelMismatch: "model mismatch",
	Layout:        "bad KV layout",
	State:         "call out of order",
	NotFound:      "not found",
	Transfer:      "transfer failed",
	Corrupt:       "block failed verification",
	Timeout:       "timed out",
	PoolFull:      "pool full",
	Directory:     "directory unavailable",
	Unsupported:   "unsupported",
	Internal:      "internal error",
}

// Count is the number of defined codes; codes are dense from 0.
const Count = int(Internal) + 1

func (c Code) String() string {
	if c >= 0 && int(c) < len(names) {
		return names[c]
	}
	return fmt.Sprintf("unknown status %d", int32(c))
}

// Error is an error that carries a Code. Wrapping keeps the cause for errors.Is.
type Error struct {
	Code Code
	Msg  string
	Err  error
}

func (e *Error) Error() string {
	return e.Code.String() + e.detail()
}

// detail is the message after the code: a wrapped error of the same code
// says its own without repeating the code.
func (e *Error) detail() string {
	var inner string
	if in, ok := e.Err.(*Error); ok && in.Code == e.Code {
		inner = in.detail()
	} else if e.Err != nil {
		inner = ": " + e.Err.Error()
	}
	if e.Msg != "" {
		return ": " + e.Msg + inner
	}
	return inner
}

func (e *Error) Unwrap() error { return e.Err }

// Errorf returns an *Error with a formatted message.
func Errorf(c Code, format string, args ...any) error {
	return &Error{Code: c, Msg: fmt.Sprintf(format, args...)}
}

// Wrap returns an *Error with code c around err, or nil when err is nil.
func Wrap(c Code, err error, msg string) error {
	if err == nil {
		return nil
	}
	return &Error{Code: c, Msg: msg, Err: err}
}

// Of returns the code carried by err: OK for nil, Internal for an error that
// carries none, so a bug never reads as success.
func Of(err error) Code {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Internal
}
