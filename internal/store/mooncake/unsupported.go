//go:build !(linux && (amd64 || arm64))

package mooncake

import (
	"context"
	"runtime"

	"github.com/mcbridge/mcbridge/internal/status"
)

// The binding mirrors LP64 Linux layouts; elsewhere every entry point
// refuses, so that what imports the package still builds.

func unsupported() error {
	return status.Errorf(status.Unsupported, "Mooncake Store is not supported on %s/%s", runtime.GOOS, runtime.GOARCH)
}

// Library is never loaded on this platform.
type Library struct{}

// Load fails: the platform is not supported.
func Load(string) (*Library, error) { return nil, unsupported() }

// Path is empty.
func (*Library) Path() string { return "" }

// Has is false.
func (*Library) Has(string) bool { return false }

// Client is never opened on this platform.
type Client struct{}

// Open fails: the platform is not supported.
func Open(context.Context, Config) (*Client, error) { return nil, unsupported() }

func (*Client) Segment() string                                       { return "" }
func (*Client) Contributes() bool                                     { return false }
func (*Client) Library() *Library                                     { return nil }
func (*Client) Healthy() error                                        { return unsupported() }
func (*Client) Register(context.Context, uintptr, uint64) error       { return unsupported() }
func (*Client) Unregister(context.Context, uintptr) error             { return unsupported() }
func (*Client) Put(context.Context, string, []byte, PutOptions) error { return unsupported() }
func (*Client) Exist(context.Context, []string) ([]bool, error)       { return nil, unsupported() }
func (*Client) Remove(context.Context, string, bool) error            { return unsupported() }
func (*Client) Size(context.Context, string) (uint64, error)          { return 0, unsupported() }
func (*Client) Close() error                                          { return unsupported() }

func (*Client) StartPutFrom([]string, []Buffer, PutOptions) (*Op[[]error], error) {
	return nil, unsupported()
}

func (*Client) PutFrom(context.Context, []string, []Buffer, PutOptions) ([]error, error) {
	return nil, unsupported()
}

func (*Client) StartGetInto([]string, []Buffer) (*Op[[]Got], error) { return nil, unsupported() }

func (*Client) GetInto(context.Context, []string, []Buffer) ([]Got, error) {
	return nil, unsupported()
}
