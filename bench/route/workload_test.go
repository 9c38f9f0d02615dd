package route

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestGenerateIsDeterministic(t *testing.T) {
	a, b := Generate(DefaultWorkload), Generate(DefaultWorkload)
	assert.Equal(t, a, b, "one seed, one swarm")
	other := DefaultWorkload
	other.Seed++
	assert.NotEqual(t, a.Shared, Generate(other).Shared, "another seed, another swarm")
	require.Len(t, a.Shared, DefaultWorkload.SharedTokens)
	require.Len(t, a.Agents, DefaultWorkload.Agents)
	for _, ag := range a.Agents {
		assert.Len(t, ag.Task, DefaultWorkload.TaskTokens)
		assert.Len(t, ag.Users, DefaultWorkload.Turns)
		for _, u := range ag.Users {
			for _, tok := range u {
				assert.True(t, tok >= 0 && tok < 256, "byte tokens only")
			}
		}
	}
}

// A turn's prompt is the shared prefix, the agent's task and its history:
// each turn extends the one before.
func TestPromptsGrowByTurn(t *testing.T) {
	s := Generate(DefaultWorkload)
	answers := [][]int32{{300, 301}, {302}}
	p0, p1, p2 := s.Prompt(1, 0, nil), s.Prompt(1, 1, answers[:1]), s.Prompt(1, 2, answers)
	assert.Equal(t, s.Shared, p0[:len(s.Shared)])
	assert.Equal(t, p0, p1[:len(p0)])
	assert.Equal(t, []int32{300, 301}, p1[len(p0):len(p0)+2])
	assert.Equal(t, p1, p2[:len(p1)])
	assert.Len(t, p2, DefaultWorkload.SharedTokens+DefaultWorkload.TaskTokens+3*DefaultWorkload.UserTokens+3)
	other := s.Prompt(2, 0, nil)
	assert.Equal(t, p0[:len(s.Shared)], other[:len(s.Shared)], "agents share the prefix")
	assert.NotEqual(t, p0[len(s.Shared):], other[len(s.Shared):], "and nothing after it")
}
