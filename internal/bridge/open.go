package bridge

import (
	"time"

	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/directory"
	"github.com/mcbridge/mcbridge/internal/directory/etcd"
	"github.com/mcbridge/mcbridge/internal/status"
	"github.com/mcbridge/mcbridge/internal/transport"
	"github.com/mcbridge/mcbridge/internal/transport/mooncake"
)

// openTransport builds the configured transfer engine.
func openTransport(cfg config.Config, owner string, now func() time.Time) (transport.Transport, error) {
	t := cfg.Transport
	switch t.Kind {
	case "loopback":
		return transport.NewLoopback(transport.LoopbackOptions{
			Name: owner,
			Link: transport.Link{
				Bandwidth: t.BandwidthGBps * 1e9,
				Latency:   time.Duration(t.LatencyUS * float64(time.Microsecond)),
			},
			Now: now,
		})
	case "mooncake":
		var args []string
		if t.Args != "" {
			args = []string{t.Args}
		}
		return mooncake.Open(mooncake.Config{
			Library:         t.Lib,
			Metadata:        t.Metadata,
			LocalServerName: t.LocalHostname,
			Protocol:        t.Protocol,
			ProtocolArgs:    args,
			PeerTimeout:     time.Duration(cfg.TransferTimeoutMS) * time.Millisecond,
		})
	}
	return nil, status.Errorf(status.Unsupported, "transport %q is not built in", t.Kind)
}

// openDirectory builds the configured directory.
func openDirectory(cfg config.Config) (directory.Directory, error) {
	d := cfg.Directory
	switch d.Kind {
	case "memory":
		return directory.OpenMemory(d.Name), nil
	case "etcd":
		return etcd.New(etcd.Config{
			Endpoints: d.Endpoints,
			Prefix:    d.Prefix,
			LeaseTTL:  time.Duration(d.LeaseTTLS) * time.Second,
			OpTimeout: time.Duration(d.OpTimeoutMS) * time.Millisecond,
			Username:  d.Username,
			Password:  d.Password,
			TLS:       etcd.TLSFiles{CAFile: d.CAFile, CertFile: d.CertFile, KeyFile: d.KeyFile},
		})
	}
	return nil, status.Errorf(status.Unsupported, "directory %q is not built in", d.Kind)
}
