package residency

// The eviction heap is a binary min-heap of node indices, each node knowing
// its position so that a touch, a pin or a removal fixes it in O(log n).

// less orders the heap: the block to evict first is least. Ticks are unique,
// so the order is total and evictions are deterministic.
func (t *Tree[V]) less(a, b int32) bool {
	x, y := &t.nodes[a], &t.nodes[b]
	if t.cfg.Policy != LRU && x.prio != y.prio {
		return x.prio < y.prio
	}
	return x.tick < y.tick
}

func (t *Tree[V]) heapPush(id int32) {
	t.nodes[id].heapPos = int32(len(t.heap))
	t.heap = append(t.heap, id)
	t.siftUp(len(t.heap) - 1)
}

func (t *Tree[V]) heapRemove(id int32) {
	i := int(t.nodes[id].heapPos)
	last := len(t.heap) - 1
	if i != last {
		t.heapSwap(i, last)
	}
	t.heap = t.heap[:last]
	t.nodes[id].heapPos = -1
	if i != last && !t.siftDown(i) {
		t.siftUp(i)
	}
}

func (t *Tree[V]) heapFix(id int32) {
	if i := int(t.nodes[id].heapPos); !t.siftDown(i) {
		t.siftUp(i)
	}
}

func (t *Tree[V]) heapSwap(i, j int) {
	h := t.heap
	h[i], h[j] = h[j], h[i]
	t.nodes[h[i]].heapPos = int32(i)
	t.nodes[h[j]].heapPos = int32(j)
}

func (t *Tree[V]) siftUp(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !t.less(t.heap[i], t.heap[p]) {
			return
		}
		t.heapSwap(i, p)
		i = p
	}
}

// siftDown reports whether the element moved.
func (t *Tree[V]) siftDown(i int) bool {
	start := i
	n := len(t.heap)
	for {
		c := 2*i + 1
		if c >= n {
			break
		}
		if r := c + 1; r < n && t.less(t.heap[r], t.heap[c]) {
			c = r
		}
		if !t.less(t.heap[c], t.heap[i]) {
			break
		}
		t.heapSwap(i, c)
		i = c
	}
	return i > start
}
