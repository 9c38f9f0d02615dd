package metrics

import (
	"fmt"
	"io"
	"strings"
)

// ProxyPrefix starts the series only `mcbridge proxy` writes, beside the
// mcbridge_ vocabulary every host writes.
const ProxyPrefix = "mcproxy_"

// Sample is one value of a proxy series; Label is the value of the series'
// label, if it has one.
type Sample struct {
	Label string
	Value int64
}

// ProxyVocabulary is every series of the proxy, in the order they are
// written. docs/metrics.md lists them; a test keeps the two equal.
var ProxyVocabulary = []Series{
	{Name: "requests_total", Kind: "counter", Help: "Completion, chat, infill, responses and messages requests."},
	{Name: "pinned_total", Kind: "counter", Help: "Requests forwarded pinned to a slot the proxy held."},
	{Name: "plain_total", Kind: "counter", Help: "Requests forwarded as they came."},
	{Name: "exclusive_total", Kind: "counter", Help: "Requests forwarded holding every slot of their upstream."},
	{Name: "untokenized_total", Kind: "counter", Help: "Prompts the proxy could not tokenize."},
	{Name: "restores_total", Kind: "counter", Help: "Slot restores of bridge blocks."},
	{Name: "restored_tokens_total", Kind: "counter", Help: "Tokens restored into slots."},
	{Name: "saves_total", Kind: "counter", Help: "Slots saved to publish their blocks."},
	{Name: "saved_bytes_total", Kind: "counter", Help: "Bytes of the slot files saved to publish their blocks."},
	{Name: "saves_skipped_total", Kind: "counter", Help: "Answers whose blocks the directory already had."},
	{Name: "save_failures_total", Kind: "counter", Help: "Slot saves that failed."},
	{Name: "save_mismatches_total", Kind: "counter", Help: "Saved slots that did not hold the request's tokens."},
	{Name: "queued_blocks_total", Kind: "counter", Help: "Blocks of saved slots handed to the bridge's publisher."},
	{Name: "publish_failures_total", Kind: "counter", Help: "Saved slots that failed to publish."},
	{Name: "publish_dropped_total", Kind: "counter", Help: "Saved slots dropped with the publish queue full."},
	{Name: "publishing", Kind: "gauge", Help: "1 while saved slots are published."},
	{Name: "snapshot_prompts_total", Kind: "counter", Help: "Prompts sent up to a snapshot boundary of a sliding-window or hybrid memory, each saved for its partial state."},
	{Name: "snapshot_failures_total", Kind: "counter", Help: "Snapshots not taken: the prompt, the slot save or the store failed."},
	{Name: "restore_fallbacks_total", Kind: "counter", Label: "reason", Help: "Restores that fell back to computing, by reason."},
	{Name: "slots_unconfirmed_total", Kind: "counter", Label: "why", Help: "Slots whose remembered contents the server did not confirm: treated as unknown."},
	{Name: "answer_mismatches_total", Kind: "counter", Help: "Answers whose prompt the server counted other than the proxy tokenized it."},
	{Name: "route_decisions_total", Kind: "counter", Label: "reason", Help: "Requests routed to an upstream, by why it was chosen."},
	{Name: "route_retries_total", Kind: "counter", Help: "Requests sent to another upstream after theirs did not answer."},
	{Name: "upstream_up", Kind: "gauge", Label: "upstream", Help: "1 while the upstream is in the rotation."},
	{Name: "upstream_in_flight", Kind: "gauge", Label: "upstream", Help: "Requests the proxy has sent to the upstream and not yet seen answered."},
	{Name: "upstream_routed_total", Kind: "counter", Label: "upstream", Help: "Requests routed to the upstream."},
	{Name: "upstream_restarts_total", Kind: "counter", Label: "upstream", Help: "Restarts of the upstream the proxy detected and learned again."},
}

// WriteProxy writes the proxy's vocabulary with the samples values gives
// for each series' name.
func WriteProxy(w io.Writer, values func(name string) []Sample) error {
	var sb strings.Builder
	for _, m := range ProxyVocabulary {
		fmt.Fprintf(&sb, "# HELP %s%s %s\n# TYPE %s%s %s\n", ProxyPrefix, m.Name, m.Help, ProxyPrefix, m.Name, m.Kind)
		for _, x := range values(m.Name) {
			if m.Label != "" && x.Label != "" {
				fmt.Fprintf(&sb, "%s%s{%s=%q} %d\n", ProxyPrefix, m.Name, m.Label, x.Label, x.Value)
			} else {
				fmt.Fprintf(&sb, "%s%s %d\n", ProxyPrefix, m.Name, x.Value)
			}
		}
	}
	_, err := io.WriteString(w, sb.String())
	return err
}
