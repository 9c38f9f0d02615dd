package gguf

// Token types (enum llama_token_type).
const (
	tokenNormal  = 1
	tokenControl = 3
)

// vocab is a byte-level BPE vocabulary as llama.cpp's "gpt2" tokenizer model expects:
// the 256 byte tokens first (token id = byte value) spelled in GPT-2's byte-to-unicode
// alphabet, then the BOS and EOS control tokens, then two-symbol tokens, each with the
// merge that makes it. Every token decodes to bytes, so whatever a random model
// generates, llama-server can turn it into text.
type vocab struct {
	tokens []string
	types  []int32
	merges []string
	bos    uint32
	eos    uint32
}

const (
	byteTokens = 256
	specials   = 2
	minVocab   = byteTokens + specials + 1 // at least one merge
	maxVocab   = byteTokens + specials + byteTokens*byteTokens
	// Spellings llama.cpp recognises, so EOS is an end-of-generation token without a
	// warning at load.
	bosTokenStr = "<s>"
	eosTokenStr = "</s>"
)

// byteToUnicode is GPT-2's map from bytes to printable runes: printable Latin-1 bytes
// stand for themselves, the others are shifted to U+0100 and up in byte order.
func byteToUnicode() [256]rune {
	var m [256]rune
	next := rune(256)
	for b := range 256 {
		if b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF {
			m[b] = rune(b)
		} else {
			m[b] = next
			next++
		}
	}
	return m
}

// mergeOrder lists the bytes in the order their pairs become tokens: letters, digits
// and space first, so that text prompts meet merges early; then every other byte.
func mergeOrder() []byte {
	var order []byte
	seen := [256]bool{}
	add := func(lo, hi byte) {
		for b := lo; b <= hi; b++ {
			order = append(order, b)
			seen[b] = true
		}
	}
	add('a', 'z')
	add('A', 'Z')
	add('0', '9')
	add(' ', ' ')
	for b := range 256 {
		if !seen[b] {
			order = append(order, byte(b))
		}
	}
	return order
}

// newVocab builds a vocabulary of size tokens, size in [minVocab, maxVocab]
// (Config.Validate checks it).
func newVocab(size int) *vocab {
	v := &vocab{
		tokens: make([]string, 0, size),
		types:  make([]int32, 0, size),
		merges: make([]string, 0, size-byteTokens-specials),
	}
	sym := byteToUnicode()
	for b := range byteTokens {
		v.tokens = append(v.tokens, string(sym[b]))
		v.types = append(v.types, tokenNormal)
	}
	v.bos = uint32(len(v.tokens))
	v.tokens = append(v.tokens, bosTokenStr)
	v.eos = uint32(len(v.tokens))
	v.tokens = append(v.tokens, eosTokenStr)
	v.types = append(v.types, tokenControl, tokenControl)

	order := mergeOrder()
	for i := 0; len(v.tokens) < size; i++ {
		a, b := string(sym[order[i/byteTokens]]), string(sym[order[i%byteTokens]])
		v.tokens = append(v.tokens, a+b)
		v.types = append(v.types, tokenNormal)
		v.merges = append(v.merges, a+" "+b)
	}
	return v
}
