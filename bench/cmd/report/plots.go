package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// series is one line of a plot.
type series struct {
	name string
	xy   plotter.XYs
}

type axes struct {
	title, x, y string
	logX        bool
	// legendTop puts the legend in the top right corner, else the bottom
	// right: wherever the lines leave room.
	legendTop bool
}

// Plot files, relative to the README.
const (
	capacityPlot   = "hit_ratio_vs_capacity.svg"
	throughputPlot = "restore_vs_memcpy.svg"
)

func linkPlot(preset string) string { return "ttft_vs_link_" + preset + ".svg" }

func writePlots(dir string, r *report) error {
	if r.Route != nil {
		if err := writeRoutePlot(dir, r.Route); err != nil {
			return err
		}
	}
	if len(r.Capacity) > 0 {
		var ss []series
		for _, ev := range []string{"lru", "cost"} {
			s := series{name: ev + " eviction"}
			for _, c := range r.Capacity {
				if c.Eviction == ev {
					s.xy = append(s.xy, plotter.XY{X: 100 * c.Fraction, Y: c.HitRatio})
				}
			}
			ss = append(ss, s)
		}
		ideal := series{name: "ideal (unbounded)"}
		for _, x := range []float64{100 * r.Capacity[0].Fraction, 100} {
			ideal.xy = append(ideal.xy, plotter.XY{X: x, Y: r.Capacity[0].Ideal})
		}
		ss = append(ss, ideal)
		a := axes{title: "Prefix hit ratio against pool capacity (sample trace)", x: "pool capacity, % of the trace's distinct blocks", y: "prefix hit ratio"}
		if err := savePlot(filepath.Join(dir, capacityPlot), a, ss); err != nil {
			return err
		}
	}
	for _, p := range presetsIn(r.Links) {
		var ss []series
		for _, key := range []string{"arbiter", "restore", "recompute"} {
			s := series{name: key}
			for _, l := range r.Links {
				if l.Preset == p {
					s.xy = append(s.xy, plotter.XY{X: l.LinkGBps, Y: l.TTFT[key].Mean / 1e3})
				}
			}
			ss = append(ss, s)
		}
		a := axes{title: "Mean TTFT over the sample trace, " + p, x: "link between servers, GB/s", y: "mean TTFT, s", logX: true, legendTop: true}
		if err := savePlot(filepath.Join(dir, linkPlot(p)), a, ss); err != nil {
			return err
		}
	}
	var ss []series
	for _, sel := range []struct{ name, bench, link string }{
		{"restore, own pool", "Restore", "local"},
		{"restore, peer over unshaped Loopback", "Restore", "unshaped"},
		{"save", "Save", ""},
	} {
		s := series{name: sel.name}
		for _, b := range r.Bench {
			if benchFamily(b) == sel.bench && b.Param("link") == sel.link {
				if size := blockBytes(b.Param("block")); size > 0 {
					s.xy = append(s.xy, plotter.XY{X: float64(size) / (1 << 20), Y: b.Metrics["x_memcpy"]})
				}
			}
		}
		if len(s.xy) > 0 {
			ss = append(ss, s)
		}
	}
	if len(ss) > 0 {
		// docs/design.md's target (§15) for restores of blocks of 1 MiB and more.
		target := series{name: "target for >= 1 MiB blocks", xy: plotter.XYs{{X: 1, Y: 0.8}, {X: 64, Y: 0.8}}}
		ss = append(ss, target)
		a := axes{title: "Throughput against memcpy of the same bytes", x: "block size, MiB", y: "x memcpy", logX: true}
		return savePlot(filepath.Join(dir, throughputPlot), a, ss)
	}
	return nil
}

func presetsIn(links []linkPoint) []string {
	var out []string
	for _, l := range links {
		if len(out) == 0 || out[len(out)-1] != l.Preset {
			out = append(out, l.Preset)
		}
	}
	return out
}

// benchFamily is a benchmark's name up to its first sub-benchmark.
func benchFamily(b benchResult) string {
	name, _, _ := strings.Cut(b.Name, "/")
	return name
}

// blockBytes reads the size at the start of a block name like "64KiB" or
// "3MiB-bench-cpu"; 0 when there is none.
func blockBytes(name string) int64 {
	i := 0
	for i < len(name) && name[i] >= '0' && name[i] <= '9' {
		i++
	}
	n, err := strconv.ParseInt(name[:i], 10, 64)
	if err != nil || n <= 0 || n > 1<<40 {
		return 0
	}
	switch {
	case strings.HasPrefix(name[i:], "KiB"):
		return n << 10
	case strings.HasPrefix(name[i:], "MiB"):
		return n << 20
	}
	return 0
}

func savePlot(path string, a axes, ss []series) error {
	p := plot.New()
	p.Title.Text = a.title
	p.X.Label.Text = a.x
	p.Y.Label.Text = a.y
	p.Add(plotter.NewGrid())
	if a.logX {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	p.Y.Min = 0
	p.Legend.Top = a.legendTop
	for i, s := range ss {
		if len(s.xy) == 0 {
			continue
		}
		l, pts, err := plotter.NewLinePoints(s.xy)
		if err != nil {
			return fmt.Errorf("plot %s: %w", path, err)
		}
		l.Color = plotutil.Color(i)
		l.Dashes = plotutil.Dashes(i)
		pts.Color = plotutil.Color(i)
		pts.Shape = plotutil.Shape(i)
		p.Add(l, pts)
		p.Legend.Add(s.name, l, pts)
	}
	return p.Save(7*vg.Inch, 4.5*vg.Inch, path)
}
