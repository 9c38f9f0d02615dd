package storenode

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

func TestReportCodec(t *testing.T) {
	var items []ReportItem
	for i := range 150 {
		items = append(items, ReportItem{Key: key.Hash{byte(i), 1, 2}, Gen: uint64(i) * 1e15})
	}
	for _, kind := range []ReportKind{ReportUsed, ReportBad, ReportWant} {
		msgs := EncodeReports(kind, items)
		require.Len(t, msgs, 3, "150 items in messages of %d", MaxReportItems)
		var got []ReportItem
		for _, m := range msgs {
			k, its, err := ParseReport(m)
			require.NoError(t, err, m)
			require.Equal(t, kind, k)
			got = append(got, its...)
		}
		want := items
		if kind != ReportBad {
			want = make([]ReportItem, len(items))
			for i := range items {
				want[i] = ReportItem{Key: items[i].Key}
			}
		}
		require.Equal(t, want, got)
	}
	for _, bad := range []string{"", "u", "x 00", "uu " + key.Hash{}.String(), "u 00", "u " + strings.Repeat("g", 32),
		"b " + key.Hash{}.String(), "b " + key.Hash{}.String() + ":x", "u " + strings.Repeat(key.Hash{}.String()+" ", MaxReportItems+1)} {
		_, _, err := ParseReport(bad)
		assert.Equal(t, status.InvalidArg, status.Of(err), "%q: %v", bad, err)
	}
}

// FuzzParseReport: a message either fails or encodes back to what it says.
func FuzzParseReport(f *testing.F) {
	f.Add("u " + key.Hash{1}.String())
	f.Add("b " + key.Hash{2}.String() + ":42 " + key.Hash{3}.String() + ":0")
	f.Add("w")
	f.Fuzz(func(t *testing.T, msg string) {
		kind, items, err := ParseReport(msg)
		if err != nil {
			require.Equal(t, status.InvalidArg, status.Of(err))
			return
		}
		again := EncodeReports(kind, items)
		require.Len(t, again, 1)
		k2, items2, err := ParseReport(again[0])
		require.NoError(t, err)
		require.Equal(t, kind, k2)
		require.Equal(t, items, items2)
	})
}
