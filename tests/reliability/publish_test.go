package reliability

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/directory/etcd/etcdtest"
	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/kvlayout/kvtest"
)

// Two processes that compute the same prompt before either sees the
// other's entries both save it; the directory keeps the first, and the
// second's blocks are deduplicated. That is an outcome of the second
// save's publish, as a publish is: the wait for it must end there, not
// wait out its deadline for blocks that will never count as published
// (TestLoad's generators met this on their first, shared prefixes).
func TestAwaitPublishLostToAnotherProcess(t *testing.T) {
	srv := etcdtest.Start(t)
	j := newJob("/race", srv.Endpoint())
	first, second := j.Config, j.Config
	first.Owner, second.Owner = "first", "second"
	a := openNode(t, first, 1024, nil)
	b := openNode(t, second, 1024, nil)
	tokens := prompt(seedA, promptLen)
	cells := kvtest.SeqCells(len(tokens))

	// The second process decides what to write before the first publishes.
	b.h.Fill(tokens, cells)
	before := b.b.Stats()
	sv, err := b.m.SaveBegin(key.Scope{}, b.h.Layout(), tokens, cells)
	require.NoError(t, err)
	for l := 0; l < layers; l++ {
		require.NoError(t, sv.SaveLayer(l))
	}
	won, err := a.save(key.Scope{}, tokens)
	require.NoError(t, err)
	require.NoError(t, won.PublishErr)
	require.Equal(t, fullBlocks, won.Published, "the first process's save: %+v", won)
	waitMatched(t, b.m, key.Scope{}, tokens, fullBlocks)

	res, err := sv.End()
	require.NoError(t, err)
	require.Equal(t, fullBlocks, res.Queued, "the second save queued its blocks: %+v", res)
	lost := awaitPublish(b.b, before, res)
	require.NoError(t, lost.PublishErr, "the second save's publish: %+v", lost)
	assert.Zero(t, lost.Published, "blocks the second save published: %+v", lost)
	assert.Equal(t, fullBlocks, lost.Deduped, "blocks the second save found published first: %+v", lost)
}
