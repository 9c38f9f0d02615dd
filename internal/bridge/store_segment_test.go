package bridge

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func FuzzParseStoreSegment(f *testing.F) {
	for _, s := range []string{"", "mooncake-store://", "mooncake-store://h:1/", "mooncake-store://h:1/127.0.0.1:13000",
		"mooncake-store:///x", "127.0.0.1:13000", "mooncake-store://a/b/c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, seg string) {
		master, writer, ok := parseStoreSegment(seg)
		if !ok {
			return
		}
		require.NotEmpty(t, master)
		require.NotContains(t, master, "/")
		require.Equal(t, seg, storeSegment(master, writer), "parse then format gives the input back")
	})
}
