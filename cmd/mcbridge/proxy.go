package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/mcbridge/mcbridge/internal/bridge"
	"github.com/mcbridge/mcbridge/internal/config"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/proxy"
	"github.com/mcbridge/mcbridge/internal/proxy/route"
)

func init() {
	commands["proxy"] = command{"share KV between stock llama-servers: a reverse proxy that restores and publishes slot files", runProxy}
}

// upstreamFlags collects --upstream URL[,slots=DIR][,patched], repeated.
type upstreamFlags []proxy.Upstream

func (u *upstreamFlags) String() string { return fmt.Sprint(*u) }

func (u *upstreamFlags) Set(v string) error {
	parts := strings.Split(v, ",")
	up := proxy.Upstream{URL: parts[0]}
	for _, opt := range parts[1:] {
		switch k, val, _ := strings.Cut(opt, "="); {
		case k == "slots" && val != "":
			up.SlotDir = val
		case k == "patched" && val == "":
			up.Patched = true
		default:
			return fmt.Errorf("upstream %q: unknown option %q (want slots=DIR or patched)", v, opt)
		}
	}
	*u = append(*u, up)
	return nil
}

func runProxy(args []string) error {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	var ups upstreamFlags
	fs.Var(&ups, "upstream", "a llama-server behind the proxy: URL[,slots=DIR][,patched]; repeat for several (default http://127.0.0.1:8080)")
	listen := fs.String("listen", "127.0.0.1:8081", "address clients connect to")
	slotDir := fs.String("slot-dir", "", "the --slot-save-path of the one upstream, on this host (several: give each its slots=DIR)")
	policy := fs.String("route", "cache-aware", "how requests choose an upstream: cache-aware, round-robin or least-loaded")
	health := fs.Duration("health-interval", time.Second, "how often each upstream's health is checked")
	cfgDoc := fs.String("config", "", "bridge configuration: JSON or a file path (default $MCB_CONFIG)")
	modelPath := fs.String("model-path", "", "the GGUF the server runs, when /props' path is relative or not readable here")
	noPublish := fs.Bool("no-publish", false, "restore only, never publish")
	ctxShift := fs.Bool("upstream-context-shift", false, "the server runs with --context-shift: publish nothing")
	cacheReuse := fs.Int("upstream-cache-reuse", 0, "the server's --cache-reuse: above 0, publish nothing")
	tenant := fs.String("tenant", "", "salt for every key: only proxies with the same tenant share")
	apiKey := fs.String("upstream-api-key", "", "the server's --api-key, for the proxy's own calls (default $MCB_UPSTREAM_API_KEY)")
	wait := fs.Duration("wait", 2*time.Minute, "how long to wait for the server at start")
	verbose := fs.Bool("v", false, "log every fallback and each restore's timings")
	if err := fs.Parse(args); err != nil {
		return err
	}
	// Read here, not as the flag's default, which -h would print.
	if *apiKey == "" {
		*apiKey = os.Getenv("MCB_UPSTREAM_API_KEY")
	}
	if len(ups) == 0 {
		ups = upstreamFlags{{URL: "http://127.0.0.1:8080"}}
	}
	if *slotDir != "" {
		if len(ups) != 1 || ups[0].SlotDir != "" {
			return fmt.Errorf("--slot-dir names the slot directory of one upstream; with several, give each --upstream URL,slots=DIR")
		}
		ups[0].SlotDir = *slotDir
	}
	stock := false
	for _, u := range ups {
		stock = stock || u.SlotDir != ""
	}
	if !stock {
		return fmt.Errorf("no upstream has a slot directory: give --slot-dir (one upstream) or --upstream URL,slots=DIR (the directory llama-server was given with --slot-save-path)")
	}
	pol, err := route.ParsePolicy(*policy)
	if err != nil {
		return err
	}
	cfg, err := config.Load(*cfgDoc)
	if err != nil {
		return err
	}
	if cfg.KVEvents.Instance == "" {
		cfg.KVEvents.Instance = *listen // where routers send this proxy's requests
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	b, err := bridge.Open(cfg, bridge.Deps{})
	if err != nil {
		return err
	}
	bridgeOpen := true
	defer func() {
		if bridgeOpen {
			_ = b.Close()
		}
	}()
	p, err := proxy.New(b, proxy.Options{
		Upstreams: ups, ModelPath: *modelPath, APIKey: *apiKey,
		NoPublish: *noPublish, UpstreamContextShift: *ctxShift, UpstreamCacheReuse: *cacheReuse,
		Route: route.Config{Policy: pol}, HealthInterval: *health,
		Scope: key.Scope{TenantSalt: []byte(*tenant)}, Log: log,
	})
	if err != nil {
		return err
	}
	// Learning now reports a misconfiguration at start; the proxy serves
	// (without the bridge where it did not learn) either way and tries
	// again later.
	deadline := time.Now().Add(*wait)
	for _, u := range ups {
		if err := waitHealthy(u.URL, time.Until(deadline)); err != nil {
			log.Warn("upstream not healthy yet; forwarding without the bridge until it is", "upstream", u.URL, "err", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), max(time.Until(deadline), time.Second))
	_ = p.Learn(ctx)
	cancel()

	srv, err := serveHTTP(*listen, p, 10*time.Second)
	if err != nil {
		return err
	}
	st := p.State()
	log.Info("proxy serving", "listen", srv.Addr(), "upstreams", len(ups), "route", pol.String(), "segment", b.Segment(),
		"owner", b.Owner(), "directory", cfg.Directory.Kind, "transport", cfg.Transport.Kind,
		"bridge", st.Bridge, "publishing", st.Publishing)
	// The first line on stdout is machine-readable, for scripts.
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{"listen": srv.Addr(), "segment": b.Segment(),
		"owner": b.Owner(), "bridge": st.Bridge, "fingerprint": st.Fingerprint})

	srv.untilSignal(log, "finishing publishes, then unpublishing this proxy's blocks", 30*time.Second)
	perr := p.Close()
	bridgeOpen = false
	if err := b.Close(); err != nil {
		return err
	}
	return perr
}

// waitHealthy polls the server's /health until it answers 200.
func waitHealthy(base string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	client := &http.Client{Timeout: 5 * time.Second}
	for {
		resp, err := client.Get(base + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("/health: HTTP %d", resp.StatusCode)
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}
