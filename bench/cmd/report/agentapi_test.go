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
		run.Requests = append(run.Requests, agentapi.Request{Agent: a, API: api[a], TTFTMS: ttft[a], Restored: restored, Answer: "same"})
	}
	return run
}

func TestAgentAPISection(t *testing.T) {
	mr := [2]string{"messages", "responses"}
	rep := agentapi.Report{Note: "both sides measured in one run", Servers: 1, Slots: 2, Agents: 2, Turns: 1, Predict: 8, Words: 400, Model: "m", Seconds: 90}
	for _, sw := range []struct {
		name                 string
		stock, proxy         [2]float64
		stockSpan, proxySpan float64
		exclusive            float64
		apis                 [2]string
	}{
		{"messages", [2]float64{2000, 3000}, [2]float64{1000, 1500}, 9000, 5000, 0, [2]string{"messages", "messages"}},
		{"mixed", [2]float64{2000, 3000}, [2]float64{1000, 3500}, 9000, 5000, 0, mr},
	} {
		stock := agentRun(sw.name, "stock", sw.stockSpan, sw.stock, sw.apis, 0)
		proxy := agentRun(sw.name, "proxy", sw.proxySpan, sw.proxy, sw.apis, 512)
		proxy.Exclusive = sw.exclusive
		rep.Runs = append(rep.Runs, stock, proxy)
		rep.Rows = append(rep.Rows, agentapi.Compare(stock, proxy))
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
	assert.Contains(t, text, "| messages | 2 | 9.0 s | 5.0 s | 3.0 s | 1.5 s | 3.0 s | 1.5 s | 0 of 2 | 2 of 2 | 0 |")
	assert.Contains(t, text, "| mixed | 2 | 9.0 s | 5.0 s | 3.0 s | 3.5 s | 3.0 s | 3.5 s | 1 of 2 | 2 of 2 | 0 |")
	assert.Contains(t, text, "| 1 | 0 | 3.0 s m | 1.5 s (512) | 3.0 s r | **3.5 s (512)** |", "every request, the slower one in bold")
	assert.Contains(t, text, "| slower: messages 0 of 2, mixed 1 of 2 | **not met** |")
	assert.Contains(t, text, "| messages 9.0 s → 5.0 s, mixed 9.0 s → 5.0 s | **met** |")
	assert.Contains(t, text, "| messages 0, mixed 0 | **met** |")
	assert.Contains(t, text, "Both sides measured in one run")

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

	// A swarm whose proxy run is missing is refused, not rendered half.
	rep.Runs = rep.Runs[:3]
	write(rep)
	_, err = readAgentAPI(path)
	assert.ErrorContains(t, err, `swarm "mixed" lacks a stock or a proxy run`)
	require.NoError(t, os.WriteFile(path, []byte(`{"rows":[]}`), 0o644))
	_, err = readAgentAPI(path)
	assert.Error(t, err)
}
