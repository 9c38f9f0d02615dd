package route

// The benchmark's results, as bench/out/route.json holds them and
// bench/cmd/report renders them.

// Request is one replayed request as the client saw it.
type Request struct {
	Agent    int     `json:"agent"`
	Turn     int     `json:"turn"`
	Prompt   int     `json:"prompt_tokens"`
	CacheN   int     `json:"cache_n"`
	Restored int     `json:"restored"`
	Upstream int     `json:"upstream"`
	TTFTMS   float64 `json:"ttft_ms"`
	// Answer is what the model generated.
	Answer []int32 `json:"answer"`
}

// Percentiles of TTFT, in ms.
type Percentiles struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
}

// Result is one policy's run.
type Result struct {
	Policy         string           `json:"policy"`
	Requests       int              `json:"requests"`
	PromptTokens   int              `json:"prompt_tokens"`
	CachedTokens   int              `json:"cached_tokens"`   // the servers' cache_n: held or restored
	RestoredTokens int              `json:"restored_tokens"` // of which restored from the bridge
	PrefixHitRatio float64          `json:"prefix_hit_ratio"`
	LocalHitRatio  float64          `json:"local_hit_ratio"` // held by the slot, nothing moved
	TTFT           Percentiles      `json:"ttft_ms"`
	RestoredBytes  int64            `json:"restored_bytes"`
	SavedBytes     int64            `json:"saved_bytes"`
	BytesMoved     int64            `json:"bytes_moved"`
	PerUpstream    []int            `json:"per_upstream"`
	Decisions      map[string]int64 `json:"decisions"`
	Seconds        float64          `json:"seconds"`
	Trace          []Request        `json:"requests_trace"`
}

// Report is what bench/out/route.json holds.
type Report struct {
	Note             string   `json:"note"`
	Date             string   `json:"date"`
	LoadStart        string   `json:"loadavg_start"`
	LoadEnd          string   `json:"loadavg_end"`
	Workload         Workload `json:"workload"`
	Model            string   `json:"model"`
	Upstreams        int      `json:"upstreams"`
	Slots            int      `json:"slots_per_upstream"`
	Results          []Result `json:"results"`
	OutputsIdentical bool     `json:"outputs_identical"`
	// Differing lists, per policy after the first, the requests (agent,
	// turn) whose prompt was the first policy's but whose answer was not.
	Differing map[string][]string `json:"differing,omitempty"`
	Seconds   float64             `json:"seconds"`
}
