package orchestrator

import (
	"time"

	"github.com/mcbridge/mcbridge/bridge/config"
	"github.com/mcbridge/mcbridge/bridge/directory"
	"github.com/mcbridge/mcbridge/bridge/status"
	"github.com/mcbridge/mcbridge/bridge/transport"
)

// openTransport builds the configured transfer engine.
func openTransport(cfg config.Config, owner string, now func() time.Time) (transport.Transport, error) {
	switch cfg.Transport.Kind {
	case "loopback":
		return transport.NewLoopback(transport.LoopbackOptions{
			Name: owner,
			Link: transport.Link{
				Bandwidth: cfg.Transport.BandwidthGBps * 1e9,
				Latency:   time.Duration(cfg.Transport.LatencyUS * float64(time.Microsecond)),
			},
			Now: now,
		})
	}
	return nil, status.Errorf(status.Unsupported, "transport %q is not built in", cfg.Transport.Kind)
}

// openDirectory builds the configured directory.
func openDirectory(cfg config.Config, owner string) (directory.Directory, error) {
	switch cfg.Directory.Kind {
	case "memory":
		return directory.OpenMemory(cfg.Directory.Name), nil
	}
	return nil, status.Errorf(status.Unsupported, "directory %q is not built in", cfg.Directory.Kind)
}
