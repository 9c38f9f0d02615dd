package etcd

import (
	"encoding/hex"
	"strings"

	"github.com/mcbridge/mcbridge/internal/key"
	"github.com/mcbridge/mcbridge/internal/status"
)

// Key layout: one key per block, grouped by model so that a subscriber
// reads and watches one model's range only.
//
//	<prefix>/<model fingerprint hex>/b/<block key hex>

// modelPrefix is the range holding every block of model, ending in "/".
func modelPrefix(prefix string, model key.Fingerprint) string {
	return prefix + "/" + model.String() + "/b/"
}

func blockKey(prefix string, model key.Fingerprint, k key.BlockKey) string {
	return modelPrefix(prefix, model) + k.String()
}

// parseBlockKey reads the block key from a full etcd key under
// modelPrefix.
func parseBlockKey(modelPrefix string, etcdKey []byte) (key.BlockKey, error) {
	var k key.BlockKey
	s := string(etcdKey)
	rest, ok := strings.CutPrefix(s, modelPrefix)
	if !ok || len(rest) != hex.EncodedLen(len(k)) {
		return k, status.Errorf(status.Directory, "etcd key %q: not %s<32 hex digits>", s, modelPrefix)
	}
	// Only the lower-case form that blockKey writes names a block.
	if _, err := hex.Decode(k[:], []byte(rest)); err != nil || k.String() != rest {
		return key.BlockKey{}, status.Errorf(status.Directory, "etcd key %q: not lower-case hex", s)
	}
	return k, nil
}

// parseAnyKey reads the model and block key from a full etcd key under
// prefix + "/", for subscribers of every model.
func parseAnyKey(prefix string, etcdKey []byte) (key.Fingerprint, key.BlockKey, error) {
	var fp key.Fingerprint
	rest, ok := strings.CutPrefix(string(etcdKey), prefix+"/")
	n := hex.EncodedLen(len(fp))
	if !ok || len(rest) < n {
		return fp, key.BlockKey{}, status.Errorf(status.Directory, "etcd key %q: not under %s/<model>/b/", etcdKey, prefix)
	}
	if _, err := hex.Decode(fp[:], []byte(rest[:n])); err != nil || fp.String() != rest[:n] {
		return fp, key.BlockKey{}, status.Errorf(status.Directory, "etcd key %q: model is not lower-case hex", etcdKey)
	}
	k, err := parseBlockKey(modelPrefix(prefix, fp), etcdKey)
	return fp, k, err
}
