// Package route replays an agent-swarm workload through three stock
// llama-servers behind one `mcbridge proxy`, once per routing policy
// (cache-aware, round-robin, least-loaded) in the same run, and reports
// each policy's prefix hit ratio, mean and p90 time to first token, and the
// KV bytes it moved (docs/bench/README.md, "Routing").
//
//	bench/route/run.sh
//
// # The workload
//
// Generate builds it from a fixed seed. Agents agents share one system
// prompt followed by a tool schema (SharedTokens tokens together: what
// every request of the swarm starts with). Each agent then works on a task
// of its own (TaskTokens tokens) in Turns turns: turn k's prompt is the
// shared prefix, the task, every earlier turn's user message and the
// answer the model gave to it, then turn k's user message (UserTokens
// tokens, a tool result or an instruction). Answers are Predict tokens,
// generated greedily by the servers, so a conversation's prompts depend
// on what the model said, as an agent's do. Agents start Stagger apart and
// run their turns one after another, concurrently with each other. The
// swarm is taken as running already: before the agents start, one request
// through the proxy computes the shared prefix and it is published (not
// measured).
//
// Token ids are drawn from the byte tokens of the generated vocabularies
// (0..255), which spell no special token, so any prompt is a valid one.
package route

import (
	"math/rand/v2"
	"time"
)

// Workload configures the swarm.
type Workload struct {
	Seed         uint64
	Agents       int
	Turns        int
	SharedTokens int
	TaskTokens   int
	UserTokens   int
	Predict      int
	Stagger      time.Duration
}

// DefaultWorkload is the benchmark's: five agents, a shared prefix of 2048
// tokens, three turns each; small enough for a loaded two-core machine.
// Five, not six: with a multiple of the three upstreams, round robin would
// send each agent back to its own server turn after turn by accident.
var DefaultWorkload = Workload{Seed: 13, Agents: 5, Turns: 3, SharedTokens: 2048, TaskTokens: 128, UserTokens: 64,
	Predict: 16, Stagger: 250 * time.Millisecond}

// Agent is one agent's part of the workload.
type Agent struct {
	Task  []int32   // after the shared prefix
	Users [][]int32 // one user message per turn
}

// Swarm is a generated workload.
type Swarm struct {
	Shared []int32 // the system prompt and tool schema
	Agents []Agent
}

// Generate builds the workload w describes; equal configurations give
// equal swarms.
func Generate(w Workload) Swarm {
	rng := rand.New(rand.NewPCG(w.Seed, 0x9e3779b97f4a7c15))
	draw := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(rng.IntN(256))
		}
		return out
	}
	s := Swarm{Shared: draw(w.SharedTokens)}
	for range w.Agents {
		a := Agent{Task: draw(w.TaskTokens)}
		for range w.Turns {
			a.Users = append(a.Users, draw(w.UserTokens))
		}
		s.Agents = append(s.Agents, a)
	}
	return s
}

// Prompt is turn k's prompt of agent a, given the answers of its earlier
// turns.
func (s Swarm) Prompt(a, k int, answers [][]int32) []int32 {
	ag := s.Agents[a]
	out := append(append([]int32(nil), s.Shared...), ag.Task...)
	for j := 0; j < k; j++ {
		out = append(out, ag.Users[j]...)
		out = append(out, answers[j]...)
	}
	return append(out, ag.Users[k]...)
}
