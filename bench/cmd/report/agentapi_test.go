package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/bench/agentapi"
)

// agentRun is one side of a swarm of two agents of one turn.
func agentRun(swarm, side string, makespan float64, ttft [2]float64, api [2]string, restored int) agentapi.Run {
	run := agentapi.Run{Swarm: swarm, Side: side, MakespanMS: makespan}
	for a := range 2 {
		run.Requests = append(run.Requests, agentapi.Request{Agent: a, API: api[a], TTFTMS: ttft[a], Restored: restored})
	}
	return run
}

func TestAgentAPISection(t *testing.T) {
	rep := agentapi.Report{Note: "all sides measured in one run", Servers: 1, Slots: 2, Agents: 2, Turns: 1, Predict: 8, Words: 400, Model: "m", Seconds: 90}
	for _, sw := range []struct {
		name                   string
		uncached, stock, proxy [2]float64
		apis                   [2]string
	}{
		// The second agent's proxy request: slower than its stock twin
		// only; then slower than both.
		{"messages", [2]float64{4000, 5000}, [2]float64{2000, 3000}, [2]float64{1000, 3500}, [2]string{"messages", "messages"}},
		{"mixed", [2]float64{4000, 5000}, [2]float64{2000, 3000}, [2]float64{1000, 5500}, [2]string{"messages", "responses"}},
	} {
		runs := []agentapi.Run{agentRun(sw.name, "uncached", 12000, sw.uncached, sw.apis, 0),
			agentRun(sw.name, "stock", 9000, sw.stock, sw.apis, 0), agentRun(sw.name, "proxy", 5000, sw.proxy, sw.apis, 512)}
		rep.Runs = append(rep.Runs, runs...)
		rep.Rows = append(rep.Rows, agentapi.Compare(runs[0], runs[1], runs[2]))
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "agentapi.json")
	write := func(rep agentapi.Report) {
		b, err := json.Marshal(rep)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, b, 0o644))
	}
	write(rep)
	got, err := readAgentAPI(path)
	require.NoError(t, err)
	r := &report{AgentAPI: got}
	var out bytes.Buffer
	r.writeAgentAPI(&md{w: &out})
	text := out.String()
	assert.Contains(t, text, "| messages | 2 | 12.0 s | 9.0 s | 5.0 s | 5.0 s | 3.0 s | 3.5 s | 5.0 s | 3.0 s | 3.5 s | 0 of 2 | 1 of 2 | 0 |")
	assert.Contains(t, text, "| mixed | 2 | 12.0 s | 9.0 s | 5.0 s | 5.0 s | 3.0 s | 5.5 s | 5.0 s | 3.0 s | 5.5 s | 1 of 2 | 1 of 2 | 0 |")
	assert.Contains(t, text, "| 1 | 0 | 5.0 s m | 3.0 s | _3.5 s (512)_ | 5.0 s r | 3.0 s | **5.5 s (512)** |", "every request, the slower ones marked")
	assert.Contains(t, text, "| slower than its uncached twin: messages 0 of 2, mixed 1 of 2 | **not met** |")
	assert.Contains(t, text, "| messages 9.0 s → 5.0 s, mixed 9.0 s → 5.0 s | **met** |")
	assert.Contains(t, text, "| messages 0, mixed 0 | **met** |")
	assert.Contains(t, text, "All sides measured in one run")

	// A proxy that held every slot once fails the third target.
	rep.Rows[1].Exclusive = 1
	write(rep)
	got, err = readAgentAPI(path)
	require.NoError(t, err)
	assert.Equal(t, "**not met**", agentTargets(got)[2][3])

	none, err := readAgentAPI(filepath.Join(dir, "absent.json"))
	assert.NoError(t, err)
	assert.Nil(t, none)
	out.Reset()
	(&report{}).writeAgentAPI(&md{w: &out})
	assert.Contains(t, out.String(), "Not run: `go test -run '^$' -bench AgentAPI")

	// A swarm that lacks a run is refused, not rendered in part.
	rep.Runs = rep.Runs[:5]
	write(rep)
	_, err = readAgentAPI(path)
	assert.ErrorContains(t, err, `swarm "mixed" lacks one of the runs [uncached stock proxy]`)
	require.NoError(t, os.WriteFile(path, []byte(`{"rows":[]}`), 0o644))
	_, err = readAgentAPI(path)
	assert.Error(t, err)
}
