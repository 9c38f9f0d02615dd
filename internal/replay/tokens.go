package replay

// vocab is Llama 3's vocabulary size; any value works, as long as equal ids
// give equal tokens and unequal ids almost surely do not.
const vocab = 128256

// appendBlock appends n tokens of hash id id: a SplitMix64 stream seeded
// by the id, so the same id always gives the same tokens.
func appendBlock(dst []int32, id int64, n int) []int32 {
	x := uint64(id) * 0xd1342543de82ef95
	for range n {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		z ^= z >> 31
		dst = append(dst, int32(z%vocab))
	}
	return dst
}

// promptTokens writes the prompt of r into dst[:0]: its blocks' tokens in
// order, cut at the input length.
func promptTokens(dst []int32, r *Request, blockTokens int) []int32 {
	dst = dst[:0]
	for _, id := range r.HashIDs {
		dst = appendBlock(dst, id, min(blockTokens, r.InputLength-len(dst)))
	}
	return dst
}
